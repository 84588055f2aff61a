"""Multi-head attention with a configurable number of key/value heads.

    num_kv_heads == num_heads  multi-head attention (MHA, the paper)
    num_kv_heads == 1          multi-query attention (MQA, Shazeer 2019)
    in between                 grouped-query attention (GQA, Ainslie et al. 2023):
                               query head h reads key/value head h // (H / H_kv)

Self-attention is of one kind (kinds.py: softmax, the paper's; linear; sliding window);
cross-attention is always softmax. Either way a call reads projections -> attend ->
merge: the kind does a full pass, the cache a decoder step.

Shapes: hidden states (B, T, C); heads (B, H, T, D); keys/values (B, H_kv, S, D).
"""

from __future__ import annotations

import math

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transduce.attention.checks import check_dropout
from transduce.attention.disentangled import RelativePositions, disentangled_bias, \
    dropped_table
from transduce.attention.kernels import attention, kv_packed_attention, packed_self_attention
from transduce.attention.kinds import AttentionKind, SoftmaxAttention, self_attention_kind
from transduce.attention.kv_cache import Attended, AttentionCache
from transduce.attention.triton_flash import unpack_heads

# Applies rotary positions to (B, H, T, D) heads whose first position is `offset`, or
# whose positions are given per row and token (B, T).
Rotary = Callable[[Tensor, "int | Tensor"], Tensor]
# Makes a norm over the last dimension of the given size (LayerNorm, RMSNorm).
NormFactory = Callable[[int], nn.Module]


class MultiHeadAttention(nn.Module):
    """Self-attention (keys from the input itself, optionally cached) or cross-attention
    (keys and values precomputed once per source with `project_kv`).

    rotary: when given, rotary positions are applied to the queries and keys of
    self-attention. Cross-attention gets none: positions of two different sequences
    have no relative meaning.
    kind: how self-attention attends: an AttentionKind, or its name ("softmax", "linear",
    "sliding" with `window`), as ModelConfig.attention_type names it.
    impl "naive" computes every kind in its quadratic reference form (and can return the
    weights); "sdpa" and "flash" use the kind's efficient algorithm.
    head_dim: each head's size; None: d_model / num_heads. Heads of another size (T5
    v1.1's) make the queries num_heads * head_dim wide, which out_proj maps to d_model.
    qk_norm: when given, makes q_norm and k_norm over head_dim, applied to every head's
    queries and keys as they are split, before rotary positions (Qwen3's): the cache
    then holds normalized keys, and cross-attention's keys are normalized once per
    source. qk_norm_across_heads: they are made over every head of a position together
    (num_heads * head_dim, num_kv_heads * head_dim: OLMo 2's), AcrossHeads;
    qk_norm_per_head: each head's with a gain of its own and no bias (StableLM 2 12B's),
    PerHead.
    softcap: every score s becomes softcap * tanh(s / softcap) (Gemma 2's; see
    kernels.attention), self- and cross-attention alike.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, *,
                 bias: bool = True, dropout: float = 0.0, impl: str = "sdpa",
                 rotary: Rotary | None = None, kind: AttentionKind | str = "softmax",
                 window: int = 16, scale_scores: bool = True, qkv_bias: bool | None = None,
                 head_dim: int | None = None, qk_norm: NormFactory | None = None,
                 softcap: float | None = None, qk_norm_across_heads: bool = False,
                 qk_norm_per_head: bool = False):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if d_model < 1 or num_heads < 1:
            raise ValueError(f"d_model={d_model} and num_heads={num_heads} must be positive")
        check_dropout(dropout, "dropout")
        if head_dim is None and d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if head_dim is not None and head_dim < 1:
            raise ValueError(f"head_dim={head_dim} must be positive")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.kind = self_attention_kind(kind, window) if isinstance(kind, str) else kind
        self.head_dim = d_model // num_heads if head_dim is None else head_dim
        self.dropout, self.impl, self.rotary, self.softcap = dropout, impl, rotary, softcap
        # False: scores q . k without the 1/sqrt(d_k) (the lab's experiment): the queries
        # are multiplied by sqrt(d_k), which the kernels' scale then cancels exactly.
        self.query_factor = 1.0 if scale_scores else math.sqrt(self.head_dim)
        kv_dim = num_kv_heads * self.head_dim
        qkv_bias = bias if qkv_bias is None else qkv_bias     # Qwen2: these alone
        self.q_proj = nn.Linear(d_model, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, kv_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(num_heads * self.head_dim, d_model, bias=bias)
        self.qkv_proj: nn.Linear | None = None     # fuse_self_projections()
        # Training makes one product of the projections that read one input (q, k and v;
        # cross-attention's k and v), their weights stacked at each call; False: one
        # product each (a benchmark's reference).
        self.stack_in_training = True
        self.q_norm = self.k_norm = None
        if qk_norm is not None and qk_norm_across_heads:
            self.q_norm = AcrossHeads(qk_norm(num_heads * self.head_dim))
            self.k_norm = AcrossHeads(qk_norm(kv_dim))
        elif qk_norm is not None and qk_norm_per_head:
            self.q_norm = PerHead(qk_norm(self.head_dim), num_heads)
            self.k_norm = PerHead(qk_norm(self.head_dim), self.num_kv_heads)
        elif qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(self.head_dim), qk_norm(self.head_dim)

    def project_kv(self, source: Tensor, packed: bool = False) -> tuple[Tensor, Tensor] | Tensor:
        """source (B, S, C) -> keys, values (B, H_kv, S, D): cross-attention's, once per
        source. packed (a full pass's, which hands them straight back as kv): in training
        with impl "triton", the stacked product's output (B, S, 2 H_kv D) itself, whose
        gradient the kernels then give as one tensor (kv_packed_attention)."""
        self._require_separate_projections()
        if packed and self.impl == "triton" and self.k_norm is None and self.softcap is None \
                and self._stacks((self.k_proj, self.v_proj)):
            return self._stacked(source, self.k_proj, self.v_proj)
        k, v = self._project(source, self.k_proj, self.v_proj)
        return self._keys(k), self._split(v, self.num_kv_heads)

    def forward(self, x: Tensor, mask: Tensor | None = None, *,
                kv: tuple[Tensor, Tensor] | None = None, causal: bool = False,
                cache: AttentionCache | None = None, positions: Tensor | None = None,
                position_bias: Tensor | None = None, relative: RelativePositions | None = None,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, C); mask broadcastable to (B, H, T, S), True = may attend.

        kv: precomputed cross-attention keys and values (B, Hkv, S, D), or project_kv's
        packed (B, S, 2 Hkv D); None for self-attention. x may hold n rows per source,
        grouped by source (beams).
        cache: self-attention only, the cache of this layer's kind (kind.new_cache):
        this call's keys and values go into it and the queries attend to everything it
        holds (their positions start at cache.length); the mask then covers every key,
        the cached ones and this call's.
        positions (B, T): the rotary positions of each row's tokens when rows do not all
        start at the same position (left-padded prompts).
        position_bias (H, T + S - 1): a relative-position score bias (self-attention
        only; S counts the cached keys too), see attention/position_bias.py.
        relative: DeBERTa's disentangled positions (a full pass of self-attention; see
        attention/disentangled.py), projected by this layer's queries and keys.
        -> (B, T, C), and the weights (B, H, T, S) when return_weights (naive kernel).
        """
        impl = "naive" if return_weights else self.impl
        if kv is not None:
            if cache is not None:
                raise ValueError("cross-attention keys are computed once per source; "
                                 "a KV cache applies to self-attention only")
            if isinstance(kv, Tensor) and impl == "triton":      # project_kv(packed=True)'s
                result = kv_packed_attention(self._queries(x), kv, self.num_kv_heads, mask,
                                             dropout_p=self._dropout_p, impl=impl)
            else:
                if isinstance(kv, Tensor):
                    kv = unpack_heads(kv, self.num_kv_heads, self.num_kv_heads)
                result = self._cross_attention(self._queries(x), *kv, mask, impl,
                                               return_weights)
        elif self._attends_packed(impl, cache, relative):
            result = packed_self_attention(
                self._stacked(x, self.q_proj, self.k_proj, self.v_proj), self.num_heads,
                self.num_kv_heads, mask, causal=causal, dropout_p=self._dropout_p, impl=impl,
                position_bias=position_bias)
        else:
            q, k, v = self._project_self(x)                # (B, H, T, D), (B, Hkv, T, D) x 2
            if self.rotary is not None:
                start = (0 if cache is None else cache.length) if positions is None \
                    else positions
                q, k = self.rotary(q, start), self.rotary(k, start)
            if relative is not None:
                if cache is not None:
                    raise ValueError("disentangled positions bias a full pass over the "
                                     "whole input; they have no cached form")
                result = self._disentangled(q, k, v, mask, relative, impl, return_weights)
            elif cache is None:
                result = self.kind.attend(q, k, v, mask, causal=causal, impl=impl,
                                          dropout_p=self._dropout_p, return_weights=return_weights,
                                          position_bias=position_bias, softcap=self.softcap)
            else:
                result = cache.attend(q, k, v, mask, causal=causal, impl=impl,
                                      return_weights=return_weights, position_bias=position_bias,
                                      softcap=self.softcap)
        out, weights = result if return_weights else (result, None)
        out = self.out_proj(self._merge(out))                            # (B, T, C)
        return (out, weights) if return_weights else out

    def fuse_self_projections(self) -> None:
        """Stack q_proj, k_proj and v_proj into one Linear, qkv_proj: a self-attention call
        then makes one product instead of three (decoding copies, model/packed.py). The
        module serves self-attention only from then on."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if any(type(p) is not nn.Linear for p in projections):   # LoRA's: merge them first
            raise TypeError(f"fuse_self_projections stacks plain Linear weights, not "
                            f"{', '.join(sorted({type(p).__name__ for p in projections}))}")
        fused = nn.Linear(self.q_proj.in_features, sum(p.out_features for p in projections),
                          bias=self.q_proj.bias is not None, device="meta")  # weights next
        with torch.no_grad():
            fused.weight = nn.Parameter(torch.cat([p.weight for p in projections]))
            if fused.bias is not None:
                fused.bias = nn.Parameter(torch.cat([p.bias for p in projections]))
        self.qkv_proj = fused
        self.q_proj = self.k_proj = self.v_proj = None

    def _disentangled(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                      relative: RelativePositions, impl: str,
                      return_weights: bool) -> Attended:
        """Softmax attention whose scores add DeBERTa's two position terms, the table
        through this layer's own query and key projections, all over sqrt(3 D):
        q (B, H, T, D), k, v (B, H, S, D) -> out (B, H, T, D) [, weights (B, H, T, S)]."""
        table = dropped_table(relative)[None]                               # (1, R, C)
        if self.qkv_proj is None:
            query_table, key_table = self.q_proj(table), self.k_proj(table)
        else:
            query_table, key_table, _ = self.qkv_proj(table).split(
                [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                 self.num_kv_heads * self.head_dim], -1)
        query_table, key_table = self._query_heads(query_table)[0], self._keys(key_table)[0]
        scale = 1.0 / math.sqrt(3 * self.head_dim)
        bias = disentangled_bias(q, k, query_table, key_table, relative.index) * scale
        return attention(q, k, v, mask, impl=impl, dropout_p=self._dropout_p, scale=scale,
                         return_weights=return_weights, score_bias=bias)

    def _queries(self, x: Tensor) -> Tensor:
        """x (B, T, C) -> queries (B, H, T, D), times query_factor."""
        self._require_separate_projections()
        return self._query_heads(self.q_proj(x))

    def _require_separate_projections(self) -> None:
        if self.q_proj is None:
            raise ValueError("this attention's projections were fused for self-attention; "
                             "it cannot attend to a source's keys")

    def _project_self(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, C) -> queries (B, H, T, D), keys and values (B, Hkv, T, D)."""
        if self.qkv_proj is None:
            q, k, v = self._project(x, self.q_proj, self.k_proj, self.v_proj)
            return self._query_heads(q), self._keys(k), self._split(v, self.num_kv_heads)
        kv_dim = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv_dim, kv_dim], -1)
        return self._query_heads(q), self._keys(k), self._split(v, self.num_kv_heads)

    def _project(self, x: Tensor, *projections: nn.Module) -> list[Tensor]:
        """x (B, T, C) -> each projection of x (B, T, out_i). In training, plain Linear
        layers make one product of their stacked weights: narrow products waste a GPU
        (on an H200, the base model's 512 x 512 ran at 317-488 TFLOP/s, 512 x 1536 at
        503-666), and stacking the weights anew at each call keeps the parameters,
        their gradients and checkpoints as they are. Eval (decoding, one token a step)
        keeps one product each: there the copy would cost more than it saves."""
        if not self._stacks(projections):
            return [projection(x) for projection in projections]
        return list(self._stacked(x, *projections).split(
            [p.out_features for p in projections], -1))

    def _stacks(self, projections: tuple[nn.Module, ...]) -> bool:
        return self.training and self.stack_in_training and \
            all(type(p) is nn.Linear for p in projections) and \
            len({p.bias is None for p in projections}) == 1

    @staticmethod
    def _stacked(x: Tensor, *projections: nn.Linear) -> Tensor:
        """x (B, T, C) -> (B, T, sum of out_i): one product of the stacked weights."""
        weight = torch.cat([p.weight for p in projections])
        bias = None if projections[0].bias is None else torch.cat([p.bias for p in projections])
        return F.linear(x, weight, bias)

    def _attends_packed(self, impl: str, cache: AttentionCache | None,
                        relative: RelativePositions | None) -> bool:
        """Whether self-attention hands its stacked projection's output to the kernel
        whole (packed_self_attention): impl "triton" in training, where nothing changes
        the queries or keys between the product and the kernel. Its backward then
        writes the q, k and v gradients into one tensor, the product's output gradient,
        instead of three that would be concatenated into it."""
        return impl == "triton" and cache is None and relative is None \
            and self.qkv_proj is None and self._stacks((self.q_proj, self.k_proj, self.v_proj)) \
            and self.rotary is None and self.q_norm is None and self.k_norm is None \
            and self.query_factor == 1.0 and self.softcap is None \
            and isinstance(self.kind, SoftmaxAttention)

    def _query_heads(self, q: Tensor) -> Tensor:
        """Projected queries (B, T, H * D) -> heads (B, H, T, D), normalized (qk_norm)
        and times query_factor."""
        q = self._split(q, self.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return q * self.query_factor if self.query_factor != 1.0 else q

    def _keys(self, k: Tensor) -> Tensor:
        """Projected keys (B, S, Hkv * D) -> heads (B, Hkv, S, D), normalized (qk_norm)."""
        k = self._split(k, self.num_kv_heads)
        return k if self.k_norm is None else self.k_norm(k)

    @property
    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _cross_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                         impl: str, return_weights: bool) -> Attended:
        """q (R, H, T, D) against the sources' k, v (B, Hkv, S, D), R = B * n
        -> out (R, H, T, D) [, weights (R, H, T, S)].

        With n > 1, target rows b*n .. b*n + n-1 (the beams of sentence b) all read source
        b: their queries are folded into one sequence of n*T queries, so each source's keys
        and values are read once rather than once per row. mask (B or 1, 1, 1, S).
        """
        rows, sources = q.shape[0], k.shape[0]
        # An ONNX export gives every row its source's keys (export/onnx.py), and a size
        # compared while tracing would be frozen at the example's value.
        if torch.jit.is_tracing() or rows == sources:
            return attention(q, k, v, mask, impl=impl, dropout_p=self._dropout_p,
                             return_weights=return_weights, softcap=self.softcap)
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
                           return_weights=return_weights, softcap=self.softcap)
        if return_weights:
            return unfold(result[0]), unfold(result[1])
        return unfold(result)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        return split_heads(x, heads, self.head_dim)

    @staticmethod
    def _merge(x: Tensor) -> Tensor:
        return merge_heads(x)


def split_heads(x: Tensor, heads: int, head_dim: int) -> Tensor:
    """(B, T, heads * D) -> (B, heads, T, D). Sizes are read from x (not unflatten's -1
    arithmetic) so that an ONNX trace keeps B and T symbolic."""
    return x.reshape(x.shape[0], x.shape[1], heads, head_dim).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H * D)."""
    return x.transpose(1, 2).flatten(2)


class AcrossHeads(nn.Module):
    """A norm over all of a position's heads together (OLMo 2's q_norm and k_norm, over
    the whole projection) where the others normalize each head: the same statistics as
    the norm of the (B, T, H * D) projection, its gain one per feature of every head."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm                   # over H * D features

    def forward(self, x: Tensor) -> Tensor:
        """Heads (B, H, T, D) -> (B, H, T, D)."""
        batch, heads, tokens, size = x.size(0), x.size(1), x.size(2), x.size(3)
        flat = self.norm(x.transpose(1, 2).reshape(batch, tokens, heads * size))
        return flat.view(batch, tokens, heads, size).transpose(1, 2)


class PerHead(nn.Module):
    """A norm of each head's features with a gain of its own per head and no bias
    (StableLM 2 12B's q_layernorm and k_layernorm), where the others share one gain:
    `norm` gives the kind (LayerNorm or RMSNorm) and its epsilon."""

    def __init__(self, norm: nn.Module, heads: int):
        super().__init__()
        self.rms = isinstance(norm, nn.RMSNorm)
        self.size = norm.normalized_shape[0]
        self.eps = norm.eps
        self.weight = nn.Parameter(torch.ones(heads, self.size))           # (H, D)

    def forward(self, x: Tensor) -> Tensor:
        """Heads (B, H, T, D) -> (B, H, T, D)."""
        shape = (self.size,)
        normed = F.rms_norm(x, shape, None, self.eps) if self.rms else \
            F.layer_norm(x, shape, None, None, self.eps)
        return normed * self.weight.unsqueeze(1).to(normed.dtype)
