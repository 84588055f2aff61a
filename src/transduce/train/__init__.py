"""Training: the schedule, the loss, the loop with its state, log, signals and processes,
and uptraining a converted checkpoint. Checkpoints themselves are transduce.checkpoint."""
