"""Training with the paper's recipe: schedule, loss, checkpoints, the loop."""
