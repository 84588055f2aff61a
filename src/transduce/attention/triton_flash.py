"""impl="triton": FlashAttention forward and backward as Triton kernels.

The same contract as flash.py (masks, causal alignment, GQA, dropout from a seed, zeros
for rows with no key), run where tiling pays: in a GPU's on-chip memory. The kernels live
in triton_kernels.py, their launches as PyTorch operators in triton_ops.py (why: there);
this module checks what can run and lays out the arguments.

CUDA tensors run the compiled kernels. With TRITON_INTERPRET=1 set before Python starts,
they run in Triton's interpreter instead, on CPU tensors too: exact but thousands of times
slower, meant for testing the kernels on a machine without a GPU, never for training.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from transduce.attention.masks import Segments
from transduce.errors import TransduceError

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


class TritonUnavailable(TransduceError, RuntimeError):
    """impl='triton' was asked for where it cannot run (printed as one line by the CLI)."""


def triton_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Segments | None = None, *,
                     causal: bool = False, dropout_p: float = 0.0, scale: float,
                     seed: int | None = None, tiles: Tiles | None = None,
                     position_bias: Tensor | None = None) -> Tensor:
    """q (B, H, T, D), k/v (B, Hkv, S, D), mask bool broadcastable to (B, H, T, S) or a
    packed batch's Segments (read as sentence numbers: the kernels skip the tiles of other
    sentences), position_bias (H, T + S - 1) -> (B, H, T, D). seed fixes the dropout
    pattern (drawn from torch when None)."""
    return _run("attention_forward", (q, k, v), q, k, v, mask, position_bias, seed, causal,
                scale, dropout_p, tiles)


def triton_packed_attention(qkv: Tensor, heads: int, kv_heads: int,
                            mask: Tensor | Segments | None = None, *, causal: bool = False,
                            dropout_p: float = 0.0, scale: float, seed: int | None = None,
                            tiles: Tiles | None = None,
                            position_bias: Tensor | None = None) -> Tensor:
    """Self-attention over a stacked projection's output, qkv (B, T, (H + 2 Hkv) D): the
    queries', keys' and values' heads in that order (unpack_heads), -> (B, H, T, D) as
    triton_attention. Its backward writes the three gradients into one tensor like qkv:
    the stacked product's own output gradient, where separate ones would be
    concatenated into it (a copy of every self-attention's q, k and v gradients)."""
    q, k, v = unpack_heads(qkv, heads, kv_heads, kv_heads)
    return _run("packed_forward", (qkv, heads, kv_heads), q, k, v, mask, position_bias, seed,
                causal, scale, dropout_p, tiles)


def triton_kv_packed_attention(q: Tensor, kv: Tensor, kv_heads: int,
                               mask: Tensor | Segments | None = None, *, causal: bool = False,
                               dropout_p: float = 0.0, scale: float, seed: int | None = None,
                               tiles: Tiles | None = None,
                               position_bias: Tensor | None = None) -> Tensor:
    """q (B, H, T, D) over a stacked key and value projection's output (cross-attention's),
    kv (B, S, 2 Hkv D): keys' heads, then values' -> (B, H, T, D) as triton_attention.
    Its backward gives kv's gradient as one tensor like kv, with nothing to concatenate."""
    k, v = unpack_heads(kv, kv_heads, kv_heads)
    return _run("kv_packed_forward", (q, kv, kv_heads), q, k, v, mask, position_bias, seed,
                causal, scale, dropout_p, tiles)


def _run(operator: str, operands: tuple, q: Tensor, k: Tensor, v: Tensor,
         mask: Tensor | Segments | None, position_bias: Tensor | None, seed: int | None,
         causal: bool, scale: float, dropout_p: float, tiles: Tiles | None) -> Tensor:
    """Checks what can run and the q, k, v the operator will read, then runs triton_ops'
    `operator` on its own operands and the launch arguments -> out (B, H, T, D)."""
    kernels_for(q.device)
    from transduce.attention import triton_ops   # imports triton
    _check(q, k, v)
    out, _ = getattr(triton_ops, operator)(*operands, *_launch_arguments(
        q, mask, position_bias, seed, causal, scale, dropout_p, tiles))
    return out


def unpack_heads(packed: Tensor, *heads: int) -> list[Tensor]:
    """A stacked projection's output (B, T, sum(heads) D), its parts' heads side by side
    -> a view (B, h, T, D) of each part: unpack_heads(qkv, H, Hkv, Hkv) -> q, k, v."""
    batch, tokens, width = packed.shape
    if packed.stride(-1) != 1 or width % sum(heads):
        raise ValueError(f"a packed projection holds {' + '.join(map(str, heads))} heads side "
                         f"by side in unit stride; got shape {tuple(packed.shape)}, strides "
                         f"{packed.stride()}")
    split = packed.unflatten(2, (sum(heads), width // sum(heads))).split(list(heads), dim=2)
    return [part.transpose(1, 2) for part in split]


def _launch_arguments(q: Tensor, mask: Tensor | Segments | None, position_bias: Tensor | None,
                      seed: int | None, causal: bool, scale: float, dropout_p: float,
                      tiles: Tiles | None) -> tuple:
    """The operators' arguments after their own operands (q, k, v; qkv and head counts;
    q, kv and head count): mask, query and key sentence numbers
    (contiguous int32, for Segments), bias, seed, causal, scale, dropout_p, tiles."""
    numbers = (None, None)
    if isinstance(mask, Segments):
        numbers = tuple(n.to(torch.int32).contiguous() for n in (mask.queries, mask.keys))
        mask = None
    tiles = tiles or Tiles.choose(q)
    seed = _seed_tensor(seed, q.device) if dropout_p > 0 else None
    return (mask, *numbers, position_bias, seed, causal, scale, dropout_p,
            [tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages])


def _seed_tensor(seed: int | None, device: torch.device) -> Tensor:
    """The dropout's seed as the kernels read it: (1,) int64 on their device, drawn there
    when None (no wait for the host, and torch.compile keeps it in its graph)."""
    if seed is None:
        return torch.randint(0, 2**62, (1,), device=device)
    return torch.tensor([seed], dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings; `choose` picks them by device and head size."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    @staticmethod
    def choose(q: Tensor) -> Tiles:
        """64 x 64 tiles with 4 warps were fastest forward and backward on an H100 at head
        sizes 64 and 128 (bench/attention_cuda.py --sweep); larger ones ran out of shared
        memory at 128 or were slower."""
        if q.device.type != "cuda":
            return Tiles(block_m=16, block_n=16)  # the interpreter: small tiles, many edges
        return Tiles(block_m=64, block_n=64, num_warps=4, num_stages=3 if q.shape[-1] <= 64 else 2)


def kernels_for(device: torch.device) -> ModuleType:
    """The kernel module that runs on `device`, or a TritonUnavailable saying why not."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        raise TritonUnavailable(
            f"impl='triton' runs on CUDA tensors, got {device.type} tensors; set "
            "TRITON_INTERPRET=1 before starting Python to run it in Triton's interpreter "
            "(exact but very slow, for testing), or use impl='flash' or 'sdpa'")
    try:
        from transduce.attention import triton_kernels
    except ImportError as error:
        raise TritonUnavailable("impl='triton' needs the triton package "
                                "(pip install triton); use impl='flash' or 'sdpa'") from error
    # Triton picks compiled or interpreted code when its functions (its own library's
    # too) are decorated, at import: the setting cannot change afterwards.
    if is_interpreted(triton_kernels.forward_kernel) != interpret:
        raise TritonUnavailable("TRITON_INTERPRET was changed after triton was imported; "
                                "set it before starting Python")
    return triton_kernels


def is_interpreted(kernel) -> bool:
    """Whether a @triton.jit kernel runs in Triton's interpreter (TRITON_INTERPRET=1)."""
    return type(kernel).__name__ == "InterpretedFunction"


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"impl='triton' takes q, k, v of one dtype among float16, bfloat16, "
                         f"float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] > 256:
        raise ValueError(f"impl='triton' takes head sizes up to 256, got {q.shape[-1]}")


def dropout_keep_mask(batch: int, heads: int, num_queries: int, num_keys: int,
                      dropout_p: float, seed: int, device: torch.device) -> Tensor:
    """The keep mask (B, H, T, S) bool that impl='triton' draws for this seed."""
    kernels = kernels_for(device)
    keep = torch.empty((batch, heads, num_queries, num_keys), dtype=torch.int8, device=device)
    grid = (_cdiv(num_queries, 16), _cdiv(num_keys, 16), batch * heads)
    kernels.keep_mask_kernel[grid](keep, heads, num_queries, num_keys, dropout_p,
                                   _seed_tensor(seed, device), BLOCK_M=16, BLOCK_N=16)
    return keep.bool()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_width(n: int) -> int:
    """The least power of two, and at least 16 (tl.dot's least), that holds n elements: a
    kernel block's width along a head or a row."""
    return max(16, 1 << max(0, math.ceil(math.log2(n))))
