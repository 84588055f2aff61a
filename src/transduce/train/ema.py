"""An exponential moving average of the weights (Polyak averaging): a cheap alternative
to averaging checkpoints, updated after every optimizer step.

    ema <- d_n * ema + (1 - d_n) * w,    d_n = min(decay, (1 + n) / (10 + n))

after the n-th update: the ramp keeps the random initial weights from dominating a
short run (with d = 0.999 alone they would still weigh 37% after 1,000 steps).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightAverage:
    """The moving average of a model's parameters, in float32, on the model's device."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.updates = 0
        # Frozen weights (a LoRA run's) are their own average: only trained ones are kept.
        self.shadow = {name: p.detach().float().clone() for name, p in model.named_parameters()
                       if p.requires_grad}

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        weight = 1.0 - self.current_decay()
        for name, parameter in model.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(parameter.detach().float(), weight)
        self.updates += 1

    def averaged_model(self, model: nn.Module) -> nn.Module:
        """A copy of `model` holding the averaged weights, in eval mode."""
        averaged = copy.deepcopy(model).eval()
        with torch.no_grad():
            for name, parameter in averaged.named_parameters():
                if name in self.shadow:
                    parameter.copy_(self.shadow[name])
        return averaged

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.updates = state["decay"], state["updates"]
        for name, tensor in state["shadow"].items():
            self.shadow[name].copy_(tensor)
