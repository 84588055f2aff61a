"""Uptraining a converted checkpoint (the GQA paper's recipe): a fraction of the steps it
was trained for, with the learning-rate schedule where that training left it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from transduce import checkpoint
from transduce.config import ConfigError


def uptraining_defaults(init: Path, given: dict[str, Any], fraction: float) -> dict[str, Any]:
    """TrainConfig values for training on from `init`: schedule_offset = its steps, and
    with no budget in `given` (the fields set by the user), max_steps = fraction x steps."""
    steps = checkpoint.trained_steps(init)
    has_budget = bool(given.get("max_steps") or given.get("max_minutes"))
    if steps is None:
        if not has_budget:
            raise ConfigError(f"{init}: its training steps are not recorded (an import), so "
                              f"no budget follows from them; give --max-steps or --max-minutes")
        return {}
    defaults: dict[str, Any] = {"schedule_offset": steps}
    if not has_budget:
        defaults["max_steps"] = max(1, math.ceil(fraction * steps))
    return defaults
