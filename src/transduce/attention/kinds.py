"""The three kinds of self-attention, each as a small object that knows its full pass,
the cache its decoder steps use, and that cache's size by formula.

    SoftmaxAttention        the paper's: softmax(q k^T / sqrt(d)) v (kernels.py),
                            cached in a KVCache (QuantizedKVCache in int8)
    LinearAttention         elu + 1 feature map instead of softmax (linear.py), cached as
                            running sums
    SlidingWindowAttention  each token sees `window` tokens on either side, or before it
                            when causal (local.py), cached as the last window

MultiHeadAttention calls kind.attend() for a full pass and cache.attend() for a decoder
step, so it never asks which kind it has. Shapes: q (B, H, T, D); k, v (B, Hkv, T, D);
mask (B, 1, 1, S) key padding, True = may attend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from transduce.attention import masks
from transduce.attention.kernels import attention
from transduce.attention.kv_cache import (Attended, AttentionCache, Int4KVCache, KVCache,
                                          QuantizedKVCache, element_size, int4_group,
                                          kv_cache_bytes, refuse_position_bias,
                                          refuse_softcap)
from transduce.attention.linear import (LinearStateCache, linear_attention,
                                        linear_attention_weights)
from transduce.attention.local import (QuantizedSlidingKVCache, SlidingKVCache,
                                      sliding_window_attention)
from transduce.attention.sparse import Pattern, pattern_attention
from transduce.config import AttentionType, choices


class AttentionKind(Protocol):
    name: str

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool,
               impl: str, dropout_p: float = 0.0, return_weights: bool = False,
               position_bias: Tensor | None = None, softcap: float | None = None) -> Attended:
        """The full pass (no cache). impl "naive" computes the quadratic reference form,
        which alone can return the weights (B, H, T, S). position_bias (H, T + S - 1):
        softmax attention only; softcap (kernels.attention): softmax and sliding only."""

    def new_cache(self, batch: int, kv_heads: int, head_dim: int, max_len: int,
                  dtype: torch.dtype, device: torch.device | str) -> AttentionCache:
        """An empty cache for max_len tokens (torch.int8: quantized, where it applies)."""

    def cache_bytes(self, batch: int, tokens: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[int, str]:
        """One layer's cache after `tokens` tokens, by formula, and the formula in words."""


@dataclass(frozen=True)
class SoftmaxAttention:
    name: str = "softmax"

    def attend(self, q, k, v, mask, *, causal, impl, dropout_p=0.0, return_weights=False,
               position_bias=None, softcap=None):
        return attention(q, k, v, mask, causal=causal, impl=impl, dropout_p=dropout_p,
                         return_weights=return_weights, position_bias=position_bias,
                         softcap=softcap)

    def new_cache(self, batch, kv_heads, head_dim, max_len, dtype, device):
        if dtype == torch.int8:
            return QuantizedKVCache(batch, kv_heads, max_len, head_dim, device=device)
        if dtype == torch.int4:
            return Int4KVCache(batch, kv_heads, max_len, head_dim, device=device)
        return KVCache(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)

    def cache_bytes(self, batch, tokens, kv_heads, head_dim, dtype):
        size = kv_cache_bytes(tokens=tokens, batch=batch, kv_heads=kv_heads,
                              head_dim=head_dim, dtype=dtype)
        if dtype == torch.int4:
            groups = head_dim // int4_group(head_dim)
            return size, (f"kv_heads {kv_heads} x 2 (K and V) x (head_dim {head_dim} x 1/2 "
                          f"byte (int4) + {groups} x 4-byte scale) x {tokens} tokens x "
                          f"batch {batch}")
        scale = " + 4-byte scale" if dtype == torch.int8 else ""
        return size, (f"kv_heads {kv_heads} x 2 (K and V) x (head_dim {head_dim} x "
                      f"{element_size(dtype)} bytes ({_name(dtype)}){scale}) x {tokens} "
                      f"tokens x batch {batch}")


@dataclass(frozen=True)
class LinearAttention:
    name: str = "linear"

    def attend(self, q, k, v, mask, *, causal, impl, dropout_p=0.0, return_weights=False,
               position_bias=None, softcap=None):
        refuse_position_bias(position_bias, "linear attention")
        refuse_softcap(softcap, "linear attention")
        key_mask = masks.key_padding(mask, "linear attention")
        if impl != "naive" and not return_weights:
            return linear_attention(q, k, v, key_mask, causal=causal)[0]
        weights = linear_attention_weights(q, k, key_mask, causal=causal)   # (B, H, T, S)
        out = weights @ v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        return (out, weights) if return_weights else out

    def new_cache(self, batch, kv_heads, head_dim, max_len, dtype, device):
        _refuse_int8(dtype, self.name)
        return LinearStateCache(batch, kv_heads, head_dim, dtype=dtype, device=device)

    def cache_bytes(self, batch, tokens, kv_heads, head_dim, dtype):
        _refuse_int8(dtype, self.name)
        size = kv_heads * (head_dim * head_dim + head_dim) * element_size(dtype) * batch
        return size, (f"kv_heads {kv_heads} x (head_dim^2 + head_dim) = ({head_dim ** 2} + "
                      f"{head_dim}) running sums x {element_size(dtype)} bytes "
                      f"({_name(dtype)}) x batch {batch}, whatever the length")


@dataclass(frozen=True)
class SlidingWindowAttention:
    window: int = 16
    name: str = "sliding"

    def attend(self, q, k, v, mask, *, causal, impl, dropout_p=0.0, return_weights=False,
               position_bias=None, softcap=None):
        """The blocked kernel, or the band's quadratic form for the weights or capped
        scores; traced (the ONNX export, whose kernel is "naive"), the blocks, each
        attended in the naive form."""
        refuse_position_bias(position_bias, "sliding-window attention")
        if (impl != "naive" or torch.jit.is_tracing()) and not return_weights and \
                softcap is None:
            return sliding_window_attention(q, k, v, masks.key_padding(
                mask, "sliding-window attention"), self.window, causal=causal, impl=impl,
                dropout_p=dropout_p)
        band = masks.band_mask(q.shape[2], k.shape[2], self.window, causal=causal,
                               device=q.device)
        return attention(q, k, v, masks.combine(mask, band), impl="naive",
                         dropout_p=dropout_p, return_weights=return_weights, softcap=softcap)

    def new_cache(self, batch, kv_heads, head_dim, max_len, dtype, device):
        """The last window's keys; softmax attention's plain cache when max_len is within
        the window (no key ever leaves it: the band is the causal mask there), which the
        written-out decoder step covers."""
        if max_len <= self.window:
            return SoftmaxAttention().new_cache(batch, kv_heads, head_dim, max_len, dtype,
                                                device)
        if dtype in (torch.int8, torch.int4):
            return QuantizedSlidingKVCache(batch, kv_heads, self.window, head_dim,
                                           dtype=dtype, max_len=max_len, device=device)
        return SlidingKVCache(batch, kv_heads, self.window, head_dim, max_len=max_len,
                              dtype=dtype, device=device)

    def cache_bytes(self, batch, tokens, kv_heads, head_dim, dtype):
        """Softmax attention's formula over the tokens the window keeps."""
        kept = min(tokens, self.window)
        size, words = SoftmaxAttention().cache_bytes(batch, kept, kv_heads, head_dim, dtype)
        return size, words.replace(f"{kept} tokens", f"{kept} tokens (the window)") \
            if kept != tokens else words


@dataclass(frozen=True)
class SparseAttention:
    """A window plus shared keys (attention/sparse.py): "global" (the first tokens global)
    or "strided" (summary keys every `window` positions). Its cache keeps every key (the
    shared ones are anywhere before) and applies the pattern to each step's queries."""
    pattern: Pattern
    name: str = "global"

    def attend(self, q, k, v, mask, *, causal, impl, dropout_p=0.0, return_weights=False,
               position_bias=None, softcap=None):
        refuse_position_bias(position_bias, f"{self.name} attention")
        refuse_softcap(softcap, f"{self.name} attention")
        if impl != "naive" and not return_weights:
            return pattern_attention(q, k, v, masks.key_padding(mask, f"{self.name} attention"),
                                     self.pattern, causal=causal, impl=impl, dropout_p=dropout_p)
        allowed = self.pattern.mask(q.shape[2], k.shape[2], causal=causal, device=q.device)
        return attention(q, k, v, masks.combine(mask, allowed), impl="naive",
                         dropout_p=dropout_p, return_weights=return_weights)

    def new_cache(self, batch, kv_heads, head_dim, max_len, dtype, device):
        _refuse_int8(dtype, self.name)
        return PatternKVCache(self.pattern, batch, kv_heads, max_len, head_dim, dtype=dtype,
                              device=device)

    def cache_bytes(self, batch, tokens, kv_heads, head_dim, dtype):
        return SoftmaxAttention().cache_bytes(batch, tokens, kv_heads, head_dim, dtype)


class PatternKVCache(KVCache):
    """A full KV cache whose steps attend through a sparse pattern."""

    def __init__(self, pattern: Pattern, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pattern = pattern

    def attend(self, q, k, v, mask, *, causal, impl, return_weights=False, position_bias=None,
               softcap=None):
        refuse_position_bias(position_bias, "sparse attention")
        refuse_softcap(softcap, "sparse attention")
        allowed = self.pattern.mask(q.shape[2], self.length + q.shape[2], causal=causal,
                                    query_offset=self.length, device=q.device)
        return super().attend(q, k, v, masks.combine(mask, allowed), causal=False, impl=impl,
                              return_weights=return_weights)


def self_attention_kind(attention_type: AttentionType, window: int = 16,
                        global_tokens: int = 1) -> AttentionKind:
    """The kind a configuration names (ModelConfig.attention_type, attention_window,
    global_tokens)."""
    if attention_type == "linear":
        return LinearAttention()
    if attention_type == "sliding":
        return SlidingWindowAttention(window)
    if attention_type == "global":
        return SparseAttention(Pattern(window, global_tokens=global_tokens), "global")
    if attention_type == "strided":
        return SparseAttention(Pattern(window, stride=window), "strided")
    if attention_type == "softmax":
        return SoftmaxAttention()
    raise ValueError(f"unknown attention type {attention_type!r}: choose one of "
                     f"{', '.join(choices(AttentionType))}")


def _refuse_int8(dtype: torch.dtype, name: str) -> None:
    if dtype in (torch.int8, torch.int4):
        raise ValueError(f"an {_name(dtype)} cache stores softmax attention's keys and "
                         f"values; attention_type={name!r} caches something else")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
