"""Learning-rate schedules.

    noam    the paper's: linear warmup over warmup_steps, then inverse square root decay,
            which never reaches the end of anything;
    budget  a schedule that knows its budget (budgeted training, Li et al. 2020): linear
            warmup over a fraction of the budget to the same peak, then linear decay to 0
            exactly when the budget (minutes or steps) runs out, so a slow machine ends
            its run decayed rather than mid-warmup.
"""

from __future__ import annotations

from transduce.config import TrainConfig


def noam_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5); step >= 1.

    It peaks at step == warmup_steps with scale * (d_model * warmup_steps)^-0.5.
    """
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def budget_lr(progress: float, peak: float, warmup_fraction: float) -> float:
    """progress: the part of the budget spent before this step, in [0, 1]. Rises linearly
    to `peak` at warmup_fraction, then falls linearly to 0 at progress 1."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup_fraction:
        return peak * progress / warmup_fraction
    return peak * (1.0 - progress) / (1.0 - warmup_fraction)


def budget_progress(config: TrainConfig, steps_done: int, seconds: float) -> float:
    """The part of the run's budget spent: of its steps, of its minutes, whichever is
    further along (both count when both are set)."""
    by_steps = steps_done / config.max_steps if config.max_steps else 0.0
    by_time = seconds / (60 * config.max_minutes) if config.max_minutes else 0.0
    return max(by_steps, by_time)


def learning_rate(config: TrainConfig, d_model: int, steps_done: int, seconds: float) -> float:
    """The rate of the next step, after steps_done steps and `seconds` of training.
    schedule_offset moves noam along; a budget schedule always spans this run's budget."""
    if config.schedule == "noam":
        step = config.schedule_offset + steps_done + 1
        return noam_lr(step, d_model, config.warmup_steps, config.lr_scale)
    peak = config.lr_scale * (d_model * config.warmup_steps) ** -0.5
    return budget_lr(budget_progress(config, steps_done, seconds), peak, config.warmup_fraction)
