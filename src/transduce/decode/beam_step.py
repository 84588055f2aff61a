"""Beam search's choice of each step's extensions in one C++ call (beam_step.cpp).

search.best_extensions by PyTorch's operators is two dozen calls on a few small
tensors: the log-softmax, the scores' addition, the 2K best of each sentence's K x V
candidates, and which K go on in which slot (_stable_slots). At one sentence of beam 4
and 8,000 pieces they took about 100 microseconds a step, nearly all of it dispatch; the
kernel takes 26 (2-core Zen 5), and translation one sentence at a time ran 1.31x as fast
(`bench/decode.py`, "ours int8 operators"). It calls ATen's log-softmax and adds each
beam's score as the operators do, so its values are theirs to the bit; it ranks equal
candidates by position (beam, then token), which torch.topk leaves open, and skips each
block of 16 candidates that cannot enter the 2K best.

It is built on first use (transduce/native.py: about 10 s once, then loaded from torch's
extension cache). Where it cannot be built, `available()` says so once with a warning
and the search keeps PyTorch's operators; TRANSDUCE_BEAM_KERNEL=0 turns it off.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from transduce.native import NativeKernel

SOURCE = Path(__file__).with_name("beam_step.cpp")
SWITCH = "TRANSDUCE_BEAM_KERNEL"
KERNEL = NativeKernel(SOURCE, "beam step", SWITCH,
                      "beam search uses PyTorch's operators instead",
                      extra_cflags=("-fopenmp",))


def available() -> bool:
    """Whether torch.ops.transduce.beam_extensions runs here (built on first call)."""
    return KERNEL.available()


def beam_extensions(logits: Tensor, scores: Tensor, beam: int, eos_ids: Tensor
                    ) -> tuple[Tensor, ...]:
    """logits (A * K, V) on a CPU, scores (A, K) float32, eos_ids (E,) int64 -> the seven
    fields of search.Extensions, in its order."""
    if not available():
        raise RuntimeError("the beam step kernel is not built here: "
                           "beam_step.available() is False")
    return torch.ops.transduce.beam_extensions(logits, scores, beam, eos_ids)
