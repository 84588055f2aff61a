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
of 16 sentences ran 1.24x as fast.

It is built by torch.utils.cpp_extension on first use (g++ and ninja, installed by the
project's set-up script; about 20 s once, then loaded from torch's extension cache, by
a name that changes with the source, the PyTorch version and the CPU's instruction
set, as -march=native compiles for this CPU). Where it cannot be built, `available()`
says so once with a warning and decoding keeps PyTorch's kernel;
TRANSDUCE_ONE_QUERY_KERNEL=0 turns it off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from transduce.errors import TransduceWarning

SOURCE = Path(__file__).with_name("one_query.cpp")
SWITCH = "TRANSDUCE_ONE_QUERY_KERNEL"
_building = threading.Lock()
_loaded: bool | None = None               # None: not tried yet in this process


def available() -> bool:
    """Whether torch.ops.transduce.one_query_attention runs here: built (or loaded from
    the cache) on the first call; False where the switch is off or the build failed."""
    global _loaded
    if _loaded is None:
        with _building:
            if _loaded is None:
                _loaded = os.environ.get(SWITCH, "1") != "0" and _build()
    return _loaded


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, ends: Tensor,
                        scale: float) -> Tensor:
    """q (B, Hkv, G, D), k and v (B, Hkv, T, D) (views of a cache, unit stride along D),
    starts and ends int64 (B,) -> (B, Hkv, G, D): row b's G queries attend its keys
    [starts[b], ends[b]) (zeros where the range is empty). Float32 on a CPU."""
    if not available():
        raise RuntimeError("the one-query attention kernel is not built here: "
                           "one_query.available() is False")
    return torch.ops.transduce.one_query_attention(q, k, v, starts, ends, scale)


def _build() -> bool:
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(name=_extension_name(), sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"],
                           is_python_module=False, verbose=False)
        return True
    except Exception as error:  # noqa: BLE001  no compiler, no ninja, a failed build
        lines = str(error).strip().splitlines() or [type(error).__name__]
        warnings.warn(f"the one-query attention kernel could not be built ({lines[-1][:300]}); "
                      f"decoding steps use PyTorch's attention kernel instead", TransduceWarning,
                      stacklevel=3)
        return False


def _extension_name() -> str:
    """A name that changes with what the build depends on: the source, PyTorch, and the
    CPU's instruction set (-march=native)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update((platform.machine() + _cpu_flags()).encode())
    return f"transduce_one_query_{digest.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
