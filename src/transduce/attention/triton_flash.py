"""impl="triton": FlashAttention forward and backward as Triton kernels.

The same contract as flash.py (masks, causal alignment, GQA, dropout from a seed, zeros
for rows with no key), run where tiling pays: in a GPU's on-chip memory. The kernels live
in triton_kernels.py; this module checks what can run, lays out the arguments and wraps
the three launches in an autograd Function.

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
    kernels = kernels_for(q.device)
    _check(q, k, v)
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    tiles = tiles or Tiles.choose(q)
    return _TritonAttention.apply(q, k, v, mask, position_bias, causal, scale, dropout_p,
                                  seed or 0, tiles, kernels)


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
    if _is_interpreted(triton_kernels.forward_kernel) != interpret:
        raise TritonUnavailable("TRITON_INTERPRET was changed after triton was imported; "
                                "set it before starting Python")
    return triton_kernels


def _is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"impl='triton' takes q, k, v of one dtype among float16, bfloat16, "
                         f"float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] > 256:
        raise ValueError(f"impl='triton' takes head sizes up to 256, got {q.shape[-1]}")


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, causal, scale, dropout_p, seed, tiles, kernels):
        call = _Call(q, k, mask, bias, causal, scale, dropout_p, seed, tiles, kernels)
        out, lse2 = call.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse2 = ctx.saved_tensors
        bias_grad = ctx.call.bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dbias = ctx.call.backward(q, k, v, out, lse2, grad_out, bias_grad)
        return dq, dk, dv, None, dbias, None, None, None, None, None, None


class _Call:
    """One attention call's launch arguments, shared by the forward and backward launches."""

    def __init__(self, q: Tensor, k: Tensor, mask: Tensor | Segments | None, bias: Tensor | None,
                 causal: bool, scale: float, dropout_p: float, seed: int, tiles: Tiles,
                 kernels: ModuleType):
        self.batch, self.heads, self.num_queries, self.dim = q.shape
        self.kv_heads, self.num_keys = k.shape[1], k.shape[2]
        self.tiles, self.kernels = tiles, kernels
        target = (self.batch, self.heads, self.num_queries, self.num_keys)
        # Sentence numbers (B, T), (B, S) as contiguous int32, in place of a dense mask.
        self.numbers = None
        if isinstance(mask, Segments):
            self.numbers = tuple(n.to(torch.int32).contiguous() for n in (mask.queries, mask.keys))
            mask = None
        # A bool mask read as bytes; broadcast dimensions get stride 0 and cost no memory.
        self.mask = None if mask is None else mask.expand(target).view(torch.uint8)
        self.bias = None if bias is None else bias.contiguous()             # (H, T + S - 1)
        self.scalars = (self.heads, self.heads // self.kv_heads, self.num_queries,
                        self.num_keys, self.num_keys - self.num_queries)
        self.scale, self.dropout_p, self.seed = scale, dropout_p, seed
        self.constants = dict(
            HEAD_DIM=self.dim, BLOCK_D=block_width(self.dim),
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=causal,
            HAS_MASK=mask is not None, SEGMENTS=self.numbers is not None,
            DROPOUT=dropout_p > 0, HAS_BIAS=bias is not None,
            # float32 inputs get float32 products (tf32 would miss the reference by 1e-3).
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
        if q.device.type == "cuda":
            self.constants.update(num_warps=tiles.num_warps, num_stages=tiles.num_stages)

    def mask_args(self, like: Tensor) -> tuple:
        if self.mask is None:  # never read: HAS_MASK is off
            return (like, 0, 0, 0, 0)
        return (self.mask, *self.mask.stride())

    def _numbers_or(self, like: Tensor) -> tuple[Tensor, Tensor]:
        return (like, like) if self.numbers is None else self.numbers  # never read without SEGMENTS

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """-> out (B, H, T, D) in q's dtype, stored token-major (_token_major), and lse2
        (B, H, T) float32."""
        out = _token_major(q)
        lse2 = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        grid = (_cdiv(self.num_queries, self.tiles.block_m), self.batch * self.heads)
        self.kernels.forward_kernel[grid](
            q, k, v, *self.mask_args(q)[:1], *self._numbers_or(q), self._bias_or(q), out, lse2,
            *q.stride(), *k.stride(), *v.stride(), *self.mask_args(q)[1:], *_head_strides(out),
            *self.scalars, self.scale * LOG2E, self.dropout_p, self.seed, **self.constants)
        return out.transpose(1, 2), lse2

    def _bias_or(self, like: Tensor) -> Tensor:
        return like if self.bias is None else self.bias   # never read without HAS_BIAS

    def backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor,
                 grad_out: Tensor, bias_grad: bool) -> tuple[Tensor, ...]:
        """-> dq (B, H, T, D), dk, dv (B, Hkv, S, D), each in its input's dtype and stored
        token-major (_token_major), and dbias (H, T + S - 1) when bias_grad (else None)."""
        delta = (grad_out.float() * out.float()).sum(dim=-1)                  # (B, H, T)
        dq, dk, dv = _token_major(q), _token_major(k), _token_major(v)
        mask, *mask_strides = self.mask_args(q)
        strides = (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *grad_out.stride())
        scalars = (*self.scalars, self.scale * LOG2E, self.scale, self.dropout_p, self.seed)
        grid_kv = (_cdiv(self.num_keys, self.tiles.block_n), self.batch * self.kv_heads)
        bias, numbers = self._bias_or(q), self._numbers_or(q)
        self.kernels.dkdv_kernel[grid_kv](q, k, v, mask, *numbers, bias, grad_out, lse2, delta,
                                          dk, dv, *strides, *_head_strides(dk), *scalars,
                                          **self.constants)
        dbias = torch.zeros(self.bias.shape, dtype=torch.float32, device=q.device) \
            if bias_grad else None
        grid_q = (_cdiv(self.num_queries, self.tiles.block_m), self.batch * self.heads)
        self.kernels.dq_kernel[grid_q](q, k, v, mask, *numbers, bias, grad_out, lse2, delta, dq,
                                       q if dbias is None else dbias, *strides,
                                       *_head_strides(dq), *scalars, BIAS_GRAD=bias_grad,
                                       **self.constants)
        return (dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2),
                None if dbias is None else dbias.to(self.bias.dtype))


def _token_major(like: Tensor) -> Tensor:
    """An empty (B, T, H, D) buffer for a (B, H, T, D) result like `like`: the layout the
    projections write and read, so that merging an output's heads for the output
    projection, or a gradient's on its way back to the q, k, v projections, is a view
    and not a copy. The kernels store through _head_strides and are handed the buffer
    itself, not a view of it: a fresh tensor, as before, which torch.compile can let
    them write in place."""
    batch, heads, tokens, dim = like.shape
    return torch.empty((batch, tokens, heads, dim), dtype=like.dtype, device=like.device)


def _head_strides(buffer: Tensor) -> tuple[int, ...]:
    """A (B, T, H, D) buffer's strides in (B, H, T, D) order."""
    return buffer.transpose(1, 2).stride()


def dropout_keep_mask(batch: int, heads: int, num_queries: int, num_keys: int,
                      dropout_p: float, seed: int, device: torch.device) -> Tensor:
    """The keep mask (B, H, T, S) bool that impl='triton' draws for this seed."""
    kernels = kernels_for(device)
    keep = torch.empty((batch, heads, num_queries, num_keys), dtype=torch.int8, device=device)
    grid = (_cdiv(num_queries, 16), _cdiv(num_keys, 16), batch * heads)
    kernels.keep_mask_kernel[grid](keep, heads, num_queries, num_keys, dropout_p, seed,
                                   BLOCK_M=16, BLOCK_N=16)
    return keep.bool()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_width(n: int) -> int:
    """The least power of two, and at least 16 (tl.dot's least), that holds n elements: a
    kernel block's width along a head or a row."""
    return max(16, 1 << max(0, math.ceil(math.log2(n))))
