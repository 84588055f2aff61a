"""One attention signature, four kernels.

    attention(q, k, v, mask, causal=..., impl="naive" | "sdpa" | "flash" | "triton")

Shapes: q (B, H, T, D); k, v (B, H_kv, S, D) with H % H_kv == 0: query head h reads
key/value head h // (H / H_kv) (MHA when H_kv == H, GQA in between, MQA when H_kv == 1).
mask: boolean, True = may attend, broadcastable to (B, H, T, S).
causal: query i may attend key j when j <= i + S - T (queries aligned with the last keys,
which is what a cached decode step needs; the usual causal mask when T == S).

All kernels agree to float rounding, and a query row with no key to attend to yields
zeros, never NaN. Only `naive` materialises the (T, S) weights, so only it can return them.
"flash" is FlashAttention's tiling in PyTorch ops (any device); "triton" is the same
algorithm as Triton kernels, for CUDA tensors (see triton_flash.py).
position_bias (H, T + S - 1): an additive score bias by relative position (T5, ALiBi;
see position_bias.py), one vector per head; naive and sdpa expand it to (H, T, S), flash
and triton add it tile by tile.
score_bias (B or 1, H, T, S): an additive bias on each score that depends on more than
the distance (DeBERTa's disentangled positions, see disentangled.py), added as it is
(after the scale); only the written-out kernels take it, naive and sdpa.
softcap: each scaled score s becomes softcap * tanh(s / softcap) before the bias and the
mask (Gemma 2's soft-capping); only the written-out form has the scores to cap, so
"sdpa" computes it as "naive" does, and "flash" and "triton" refuse it.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from transduce.attention import masks
from transduce.attention.checks import check_dropout, check_mask, check_position_bias, \
    check_qkv, check_score_bias, check_segments
from transduce.attention.flash import tiled_attention
from transduce.attention.position_bias import expand
from transduce.attention.triton_flash import triton_attention, triton_kv_packed_attention, \
    triton_packed_attention, unpack_heads
from transduce.config import AttentionImpl, choices

IMPLS = choices(AttentionImpl)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | masks.Segments | None = None, *,
              causal: bool = False, dropout_p: float = 0.0, impl: str = "sdpa",
              return_weights: bool = False, scale: float | None = None,
              position_bias: Tensor | None = None, score_bias: Tensor | None = None,
              softcap: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(cap(q k^T * scale) + bias + mask) v, scale = 1/sqrt(D) by default, cap the
    identity unless softcap is given.

    q (B, H, T, D), k/v (B, H_kv, S, D), mask broadcastable to (B, H, T, S) or a packed
    batch's Segments, position_bias (H, T + S - 1), score_bias (B or 1, H, T, S)
    -> out (B, H, T, D), and weights (B, H, T, S) when return_weights (naive only).
    """
    # While an ONNX export traces this, a size compared in Python would be frozen at the
    # example's value; the checks and the one-query shortcut are skipped then.
    tracing = torch.jit.is_tracing()
    if isinstance(mask, masks.Segments) and impl != "triton":
        mask = check_segments(q, k, mask).dense()   # only the Triton kernel reads the numbers
    if not tracing:
        mask = _check_inputs(q, k, v, mask, impl, return_weights, dropout_p)
        check_position_bias(q, k, position_bias)
        check_score_bias(q, k, score_bias)
        # One query aligned with the last key sees every key: no causal mask to build.
        causal = causal and q.shape[2] > 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias = position_bias
    if score_bias is not None and impl in ("flash", "triton"):
        raise ValueError(f"score_bias needs the scores written out: impl 'sdpa' or "
                         f"'naive', not {impl!r}")
    if softcap is not None:
        if impl in ("flash", "triton"):
            raise ValueError(f"softcap needs the scores written out: impl 'sdpa' or "
                             f"'naive', not {impl!r}")
        impl = "naive"
    if impl == "flash":
        return tiled_attention(q, k, v, mask, causal=causal, dropout_p=dropout_p, scale=scale,
                               position_bias=bias)
    if impl == "triton":
        return triton_attention(q, k, v, mask, causal=causal, dropout_p=dropout_p, scale=scale,
                                position_bias=bias)
    if impl == "sdpa":
        return _sdpa(q, k, v, mask, causal, dropout_p, scale, bias, score_bias)
    out, weights = _naive(q, k, v, mask, causal, dropout_p, scale, bias, softcap, score_bias)
    return (out, weights) if return_weights else out


def packed_self_attention(qkv: Tensor, heads: int, kv_heads: int,
                          mask: Tensor | masks.Segments | None = None, *, causal: bool = False,
                          dropout_p: float = 0.0, impl: str = "sdpa",
                          position_bias: Tensor | None = None) -> Tensor:
    """Self-attention over a stacked projection's output qkv (B, T, (H + 2 H_kv) D), the
    queries', keys' and values' heads side by side -> (B, H, T, D), as attention() over
    its views. impl "triton" takes qkv whole, and its backward writes the three gradients
    into one tensor: the stacked product's output gradient, with nothing to concatenate."""
    q, k, v = unpack_heads(qkv, heads, kv_heads, kv_heads)
    if impl != "triton" or torch.jit.is_tracing():
        return attention(q, k, v, mask, causal=causal, dropout_p=dropout_p, impl=impl,
                         position_bias=position_bias)
    mask = _check_inputs(q, k, v, mask, impl, False, dropout_p)
    check_position_bias(q, k, position_bias)
    return triton_packed_attention(qkv, heads, kv_heads, mask, causal=causal and q.shape[2] > 1,
                                   dropout_p=dropout_p, scale=1.0 / math.sqrt(q.shape[-1]),
                                   position_bias=position_bias)


def kv_packed_attention(q: Tensor, kv: Tensor, kv_heads: int,
                        mask: Tensor | masks.Segments | None = None, *, dropout_p: float = 0.0,
                        impl: str = "sdpa") -> Tensor:
    """Attention of q (B, H, T, D) over a stacked key and value projection's output kv
    (B, S, 2 H_kv D), keys' heads then values' (cross-attention's) -> (B, H, T, D), as
    attention() over its views. impl "triton" takes kv whole, and its backward gives
    kv's gradient as one tensor: the stacked product's output gradient."""
    k, v = unpack_heads(kv, kv_heads, kv_heads)
    if impl != "triton" or torch.jit.is_tracing():
        return attention(q, k, v, mask, dropout_p=dropout_p, impl=impl)
    mask = _check_inputs(q, k, v, mask, impl, False, dropout_p)
    return triton_kv_packed_attention(q, kv, kv_heads, mask, dropout_p=dropout_p,
                                      scale=1.0 / math.sqrt(q.shape[-1]))


def _naive(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
           dropout_p: float, scale: float, position_bias: Tensor | None = None,
           softcap: float | None = None, score_bias: Tensor | None = None
           ) -> tuple[Tensor, Tensor]:
    """The formula written out. -> out (B, H, T, D), weights (B, H, T, S)."""
    batch, heads, num_queries, _ = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if causal:
        mask = masks.combine(mask, masks.causal_mask(num_queries, num_keys, device=q.device))
    # Group the query heads that share a key/value head; k and v broadcast, uncopied.
    q5 = q.unflatten(1, (kv_heads, group))                               # (B, Hkv, G, T, D)
    scores = (q5 * scale) @ k.unsqueeze(2).transpose(-1, -2)            # (B, Hkv, G, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        dense = expand(position_bias, num_queries, num_keys)            # (H, T, S)
        scores = scores + dense.unflatten(0, (kv_heads, group)).to(scores.dtype)
    if score_bias is not None:
        scores = scores + score_bias.unflatten(1, (kv_heads, group)).to(scores.dtype)
    allowed = None if mask is None else masks.group_heads(mask, kv_heads, group)
    weights = masked_softmax(scores, allowed)                           # (B, Hkv, G, T, S)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped @ v.unsqueeze(2)                                        # (B, Hkv, G, T, D)
    return out.flatten(1, 2), weights.flatten(1, 2)


def masked_softmax(scores: Tensor, allowed: Tensor | None) -> Tensor:
    """Softmax over the last dimension, restricted to allowed (True) entries.

    A row with no allowed entry would be a softmax over all -inf (NaN); it gets zeros.
    scores (..., S), allowed broadcastable to scores -> weights like scores.
    """
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    row_has_key = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~row_has_key, 0.0)
    return torch.softmax(scores, dim=-1).masked_fill(~row_has_key, 0.0)


# Up to this many keys, bfloat16 training on a CPU uses the matrix-product form: PyTorch's
# CPU flash kernel computes its bfloat16 backward 2.5-4.5x slower than the two products and
# a softmax at sentence lengths (33-128 keys on a 2-core Zen 4); from about 512 keys on,
# the fused kernel wins.
MATMUL_FORM_MAX_KEYS = 256


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
          dropout_p: float, scale: float, position_bias: Tensor | None = None,
          score_bias: Tensor | None = None) -> Tensor:
    """PyTorch's fused kernel. Its is_causal is top-left aligned, so it is used only
    for square unmasked attention; every other causal case goes through a mask."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    if (q.device.type == "cpu" and q.dtype == torch.bfloat16 and num_keys <= MATMUL_FORM_MAX_KEYS
            and torch.is_grad_enabled() and q.requires_grad):
        return _naive(q, k, v, mask, causal, dropout_p, scale, position_bias,
                      score_bias=score_bias)[0]
    if position_bias is not None or score_bias is not None:
        dense = score_bias if position_bias is None else \
            expand(position_bias, num_queries, num_keys)[None]                 # (1, H, T, S)
        if position_bias is not None and score_bias is not None:
            dense = dense + score_bias
        return _sdpa_with_bias(q, k, v, mask, causal, dropout_p, scale, dense)
    # A branch, not an expression: under torch.compile with dynamic shapes the comparison
    # is symbolic, SDPA takes only a Python bool, and a branch makes the graph guard on it.
    use_is_causal = False
    if causal and mask is None and num_queries == num_keys:
        use_is_causal = True
    if causal and not use_is_causal:
        mask = masks.combine(mask, masks.causal_mask(num_queries, num_keys, device=q.device))
    with _shape_agnostic_backends(q.device):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=use_is_causal, scale=scale,
            enable_gqa=_grouped(q, k))


def _grouped(q: Tensor, k: Tensor) -> bool:
    """Whether query heads share key/value heads (SDPA's enable_gqa), as a Python bool: a
    branch, for the reason above. Sliding-window blocks traced at one block fold the
    block count into the head count, so even the head counts can be symbolic there."""
    if k.shape[1] != q.shape[1]:
        return True
    return False


def _sdpa_with_bias(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                    dropout_p: float, scale: float, dense_bias: Tensor) -> Tensor:
    """The bias (B or 1, H, T, S) as SDPA's float mask, with a large negative number where
    a key is masked. A row with no key would then average every value: it is set to 0."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    if causal:
        mask = masks.combine(mask, masks.causal_mask(num_queries, num_keys, device=q.device))
    bias = dense_as_mask(dense_bias, mask, q.dtype)
    with _shape_agnostic_backends(q.device):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                             scale=scale, enable_gqa=_grouped(q, k))
    if mask is None:
        return out
    return out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


def bias_as_mask(position_bias: Tensor, mask: Tensor | None, num_queries: int, num_keys: int,
                 dtype: torch.dtype) -> Tensor:
    """position_bias (H, T + S - 1) and a boolean mask broadcastable to (B, H, T, S) ->
    SDPA's float mask: the bias, a large negative number where a key is masked;
    (1, H, T, S) without a mask."""
    return dense_as_mask(expand(position_bias, num_queries, num_keys)[None], mask, dtype)


def dense_as_mask(bias: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """A dense bias (B or 1, H, T, S) and a boolean mask -> SDPA's float mask in dtype."""
    bias = bias.to(dtype)
    return bias if mask is None else bias.masked_fill(~mask, torch.finfo(dtype).min / 2)


# On CUDA, PyTorch may pick cuDNN's attention, which builds an execution plan for every new
# shape: about 10 ms of CPU per call on an H100 machine, while the GPU work is a few hundred
# microseconds. Training batches and decoding steps change shape all the time, so cuDNN is
# left out; FlashAttention and memory-efficient attention have no per-shape setup.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _shape_agnostic_backends(device: torch.device):
    return sdpa_kernel(_CUDA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | masks.Segments | None,
                  impl: str, return_weights: bool,
                  dropout_p: float) -> Tensor | masks.Segments | None:
    """Clear errors for misuse; returns the mask made 4-D."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}: choose one of {', '.join(IMPLS)}")
    if return_weights and impl != "naive":
        raise ValueError(f"impl={impl!r} never materialises the attention weights; "
                         "use impl='naive' to return them")
    check_dropout(dropout_p)
    check_qkv(q, k, v)
    return check_mask(q, k, mask)
