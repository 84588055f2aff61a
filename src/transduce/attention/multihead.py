"""Multi-head attention with a configurable number of key/value heads.

    num_kv_heads == num_heads  multi-head attention (MHA, the paper)
    num_kv_heads == 1          multi-query attention (MQA, Shazeer 2019)
    in between                 grouped-query attention (GQA, Ainslie et al. 2023):
                               query head h reads key/value head h // (H / H_kv)

Self-attention comes in three kinds (`kind`): "softmax" (the paper), "linear" (a
positive feature map instead of softmax, linear.py) and "sliding" (each token sees the
`window` tokens around it, local.py). Cross-attention is always softmax.

Shapes: hidden states (B, T, C); heads (B, H, T, D); keys/values (B, H_kv, S, D).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from transduce.attention import masks
from transduce.attention.kernels import attention
from transduce.attention.kv_cache import KVCache, LinearStateCache, SlidingKVCache
from transduce.attention.linear import linear_attention, linear_attention_weights
from transduce.attention.local import sliding_window_attention

KINDS = ("softmax", "linear", "sliding")

# Applies rotary positions to (B, H, T, D) heads whose first position is `offset`.
Rotary = Callable[[Tensor, int], Tensor]


class MultiHeadAttention(nn.Module):
    """Self-attention (keys from the input itself, optionally cached) or cross-attention
    (keys and values precomputed once per source with `project_kv`).

    rotary: when given, rotary positions are applied to the queries and keys of
    self-attention. Cross-attention gets none: positions of two different sequences
    have no relative meaning.
    impl "naive" computes every kind in its quadratic reference form (and can return the
    weights); "sdpa" and "flash" use the kind's efficient algorithm.
    `recorded`: set it to a list and every forward appends its weights there (computed
    with the naive kernel): how attention maps are read from a real forward pass.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, *,
                 bias: bool = True, dropout: float = 0.0, impl: str = "sdpa",
                 rotary: Rotary | None = None, kind: str = "softmax", window: int = 16):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if kind not in KINDS:
            raise ValueError(f"unknown attention kind {kind!r}: choose one of {', '.join(KINDS)}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.kind, self.window = kind, window
        self.recorded: list[Tensor] | None = None
        self.head_dim = d_model // num_heads
        self.dropout, self.impl, self.rotary = dropout, impl, rotary
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def project_kv(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """source (B, S, C) -> keys, values (B, H_kv, S, D): cross-attention's, once per source."""
        return self._split(self.k_proj(source), self.num_kv_heads), \
            self._split(self.v_proj(source), self.num_kv_heads)

    def forward(self, x: Tensor, mask: Tensor | None = None, *,
                kv: tuple[Tensor, Tensor] | None = None, causal: bool = False,
                cache: KVCache | None = None,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, C); mask broadcastable to (B, H, T, S), True = may attend.

        kv: precomputed cross-attention keys and values (B, Hkv, S, D); None for
        self-attention. x may hold n rows per source, grouped by source (beams).
        cache: self-attention only; this call's keys and values are appended to it and
        the queries attend to everything cached (their positions start at cache.length):
        a KVCache or QuantizedKVCache (softmax), SlidingKVCache or LinearStateCache.
        -> (B, T, C), and the weights (B, H, T, S) when return_weights (naive kernel).
        """
        wanted = return_weights
        return_weights = return_weights or self.recorded is not None
        q = self._split(self.q_proj(x), self.num_heads)                  # (B, H, T, D)
        if kv is None:
            k, v = self.project_kv(x)                                    # (B, Hkv, T, D)
            if self.rotary is not None:
                start = 0 if cache is None else cache.length
                q, k = self.rotary(q, start), self.rotary(k, start)
            result = self._self_attention(q, k, v, mask, causal, cache, return_weights)
        else:
            if cache is not None:
                raise ValueError("cross-attention keys are computed once per source; "
                                 "a KV cache applies to self-attention only")
            result = self._cross_attention(q, *kv, mask, return_weights)
        out, weights = result if return_weights else (result, None)
        if self.recorded is not None:
            self.recorded.append(weights.detach())
        out = self.out_proj(self._merge(out))                            # (B, T, C)
        return (out, weights) if wanted else out

    @property
    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _cross_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                         return_weights: bool):
        """q (R, H, T, D) against the sources' k, v (B, Hkv, S, D), R = B * n
        -> out (R, H, T, D) [, weights (R, H, T, S)].

        With n > 1, target rows b*n .. b*n + n-1 (the beams of sentence b) all read source
        b: their queries are folded into one sequence of n*T queries, so each source's keys
        and values are read once rather than once per row. mask (B or 1, 1, 1, S).
        """
        impl = "naive" if return_weights else self.impl
        rows, sources = q.shape[0], k.shape[0]
        if rows == sources:
            return attention(q, k, v, mask, impl=impl, dropout_p=self._dropout_p,
                             return_weights=return_weights)
        if rows % sources or (mask is not None and (mask.dim() != 4 or mask.shape[0] not in
                                                    (1, sources) or mask.shape[2] != 1)):
            raise ValueError(f"{rows} target rows cannot share {sources} sources' keys with "
                             f"a mask of shape {None if mask is None else tuple(mask.shape)}: "
                             "rows must be a multiple of sources, the mask (B, 1, 1, S)")
        n, steps = rows // sources, q.shape[2]

        def unfold(x: Tensor) -> Tensor:  # (B, H, n * T, X) -> (B * n, H, T, X)
            return x.unflatten(2, (n, steps)).transpose(1, 2).flatten(0, 1)

        folded = q.unflatten(0, (sources, n)).transpose(1, 2).flatten(2, 3)  # (B, H, n*T, D)
        result = attention(folded, k, v, mask, impl=impl, dropout_p=self._dropout_p,
                           return_weights=return_weights)
        if return_weights:
            return unfold(result[0]), unfold(result[1])
        return unfold(result)

    def _self_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                        causal: bool, cache, return_weights: bool):
        """q (B, H, T, D), this call's k, v (B, Hkv, T, D) -> out (B, H, T, D) [, weights]."""
        impl = "naive" if return_weights else self.impl
        if self.kind == "linear":
            key_mask = masks.key_padding(mask, "linear attention")
            if return_weights and cache is not None:
                raise ValueError("linear attention's cache keeps sums, not keys: its weights "
                                 "exist only in a full (uncached) pass")
            if impl == "naive" and cache is None:
                weights = linear_attention_weights(q, k, key_mask, causal=causal)
                out = weights @ v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                return (out, weights) if return_weights else out
            if cache is not None and not isinstance(cache, LinearStateCache):
                raise ValueError("linear attention decodes with a LinearStateCache")
            out, state = linear_attention(q, k, v, key_mask, causal=causal,
                                          state=None if cache is None else cache.state)
            if cache is not None:
                cache.advance(state, q.shape[2])
            return out
        if self.kind == "sliding":
            if cache is not None:
                if not isinstance(cache, SlidingKVCache):
                    raise ValueError("sliding-window attention decodes with a SlidingKVCache")
                older = cache.held
                k, v = cache.update(k, v)   # the held window, then this call's keys
                band = masks.band_mask(q.shape[2], k.shape[2], self.window, causal=causal,
                                       query_offset=older, device=q.device)
                return attention(q, k, v, masks.combine(mask, band), impl=impl,
                                 return_weights=return_weights)
            if return_weights or impl == "naive":
                band = masks.band_mask(q.shape[2], k.shape[2], self.window, causal=causal,
                                       device=q.device)
                return attention(q, k, v, masks.combine(mask, band), impl="naive",
                                 dropout_p=self._dropout_p, return_weights=return_weights)
            return sliding_window_attention(q, k, v, masks.key_padding(mask, "sliding-window "
                                            "attention"), self.window, causal=causal,
                                            impl=impl, dropout_p=self._dropout_p)
        if cache is None:
            return attention(q, k, v, mask, causal=causal, impl=impl, dropout_p=self._dropout_p,
                             return_weights=return_weights)
        k, v = cache.update(k, v)                                        # (B, Hkv, S, D)
        # Attention runs in the cache's type (a float32 cache for a bfloat16 model, say):
        # casting the step's queries is cheap, casting the whole cache would not be.
        result = attention(q.to(k.dtype), k, v, mask, causal=causal, impl=impl,
                           dropout_p=self._dropout_p, return_weights=return_weights)
        if return_weights:
            return result[0].to(q.dtype), result[1].to(q.dtype)
        return result.to(q.dtype)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        """(B, T, heads * D) -> (B, heads, T, D)."""
        return x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    @staticmethod
    def _merge(x: Tensor) -> Tensor:
        """(B, H, T, D) -> (B, T, H * D)."""
        return x.transpose(1, 2).flatten(2)
