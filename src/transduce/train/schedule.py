"""The paper's learning rate: linear warmup, then inverse square root decay."""

from __future__ import annotations


def noam_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5); step >= 1.

    It peaks at step == warmup_steps with scale * (d_model * warmup_steps)^-0.5.
    """
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)
