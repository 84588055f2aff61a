"""One query per row, each row over its own range of cached keys: the attention of a
continuous search's decoding step, written in C++ (one_query.cpp).

In a continuous search (decode/continuous.py) the sentences that joined at different
steps own different ranges of the cache's slots. PyTorch's fused kernel takes one range
per call, so the decoding step made one call per run of sentences that joined together
(11-12 a layer at 16 sentences), each costing more in set-up than in arithmetic; one
call over every slot with a mask reads 2.5x the keys and was no faster. This kernel
takes each row's first and last slot and reads its own keys only, once for the G
queries that share them, in one call: 2.3-3.8x faster than the calls per run for 64
rows (2-core Zen 4, one thread; `python bench/one_query.py`). Cross-attention is the
same shape: a source's beams (and a kv head's group) are its G queries, and its keys
end at its own length instead of the widest running source's. With both, the search
of 16 sentences ran 1.24x as fast. Built with OpenMP, which ATen's inline parallel_for
needs (without it the kernel ran on one thread whatever PyTorch's count): at two threads
on a 2-core Zen 5, 0.62-0.70x the time of the build without it, and the search 1.53x
PyTorch's kernel against 1.19x (`python bench/one_query.py --threads 2`).

It is built on first use (transduce/native.py: about 20 s once, then loaded from
torch's extension cache). Where it cannot be built, `available()` says so once with a
warning and decoding keeps PyTorch's kernel; TRANSDUCE_ONE_QUERY_KERNEL=0 turns it off.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from transduce.native import NativeKernel

SOURCE = Path(__file__).with_name("one_query.cpp")
SWITCH = "TRANSDUCE_ONE_QUERY_KERNEL"
KERNEL = NativeKernel(SOURCE, "one-query attention", SWITCH,
                      "decoding steps use PyTorch's attention kernel instead",
                      extra_cflags=("-ffast-math", "-fopenmp"))


def available() -> bool:
    """Whether torch.ops.transduce.one_query_attention runs here (built on first call)."""
    return KERNEL.available()


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, ends: Tensor,
                        scale: float) -> Tensor:
    """q (B, Hkv, G, D), k and v (B, Hkv, T, D) (views of a cache, unit stride along D),
    starts and ends int64 (B,) -> (B, Hkv, G, D): row b's G queries attend its keys
    [starts[b], ends[b]) (zeros where the range is empty). Float32 on a CPU."""
    if not available():
        raise RuntimeError("the one-query attention kernel is not built here: "
                           "one_query.available() is False")
    return torch.ops.transduce.one_query_attention(q, k, v, starts, ends, scale)
