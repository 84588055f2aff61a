"""Attention weights read from a real forward pass, through PyTorch's forward hooks.

    with record_attention(model.attention_modules()) as recorded:
        model(src, tgt)
    recorded["cross"][layer]     # that layer's weights, one tensor per call

A model of the family exposes its attention modules by role with `attention_modules()`
({"encoder": [...], "decoder": [...], "cross": [...]}, one module per layer). A module
is recordable when its forward returns (output, weights), or takes return_weights=True
to do so (MultiHeadAttention, which then computes with the naive kernel): the hooks ask
for the weights, keep them, and hand the caller what it asked for. Nothing is stored on
the modules, and the hooks are removed on exit, even after an error.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

from torch import Tensor, nn

Recorded = dict[str, list[list[Tensor]]]     # role -> per module -> weights of each call


@contextlib.contextmanager
def record_attention(modules: dict[str, list[nn.Module]]) -> Iterator[Recorded]:
    """Record the weights of every call of these modules while the block runs."""
    recorded: Recorded = {role: [[] for _ in group] for role, group in modules.items()}
    handles = []
    try:
        for role, group in modules.items():
            for module, calls in zip(group, recorded[role]):
                handles.extend(_hook(module, calls))
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def _hook(module: nn.Module, calls: list[Tensor]) -> list:
    """Hooks that append each call's weights (detached) to `calls`."""
    asks = "return_weights" in inspect.signature(module.forward).parameters
    wanted: list[bool] = []      # whether the caller itself asked for the weights

    def before(_, args, kwargs):
        wanted.append(bool(kwargs.get("return_weights", False)))
        return args, {**kwargs, "return_weights": True}

    def after(_, args, kwargs, output):
        out, weights = output
        calls.append(weights.detach())
        return output if wanted.pop() else out

    def after_always(_, args, output):
        calls.append(output[1].detach())

    if not asks:
        return [module.register_forward_hook(after_always)]
    return [module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, with_kwargs=True)]
