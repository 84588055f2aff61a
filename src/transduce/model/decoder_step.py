"""One decoding step of a decoding copy's decoder, written out operator by operator.

A step of a small model is a few hundred operators on a few rows, and the modules around
them cost time of their own: each call goes through nn.Module's hooks machinery, each
attention call checks its inputs, picks a kernel and a mask, the cache checks shapes.
DecoderStep runs the same operators in the same order (bit-identical outputs, tested)
and calls each projection's and norm's forward directly. On a 2-core Zen 4 (demo model,
int8, two workers; the same translations, A/B over six rounds in one process) whole
translations ran 1.05x faster at beam 4 and 1.08x greedy in batches of 32 sentences,
1.23x and 1.33x one sentence at a time. It covers the common case (softmax attention
over plain KV caches, additive or no positions, PyTorch's fused attention kernel) and
leaves every other step to the modules: `covers` says which.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transduce.attention import masks
from transduce.attention.kv_cache import KVCache


def _supported(decoder: nn.Module) -> bool:
    """Whether every layer is one DecoderStep writes out: fused self-attention
    projections, no rotary positions or score biases, scaled scores, the SDPA kernel."""
    if getattr(decoder, "score_bias", None) is not None:
        return False
    for layer in decoder.layers:
        attentions = [layer.self_attn] + ([layer.cross_attn] if layer.cross_attn is not None
                                          else [])
        if layer.self_attn.qkv_proj is None or layer.self_attn.rotary is not None:
            return False
        if any(a.impl != "sdpa" or a.query_factor != 1.0 for a in attentions):
            return False
    return True


class DecoderStep:
    """Decoder.forward for one new token per row over KV caches (see the module note).
    Built by decoding copies (model/packed.py) for decoders it supports (`build`)."""

    def __init__(self, decoder: nn.Module):
        self.decoder = decoder
        first = decoder.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, \
            first.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.sizes = [self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2]

    @classmethod
    def build(cls, decoder: nn.Module) -> "DecoderStep | None":
        return cls(decoder) if _supported(decoder) else None

    def covers(self, tgt: Tensor, caches: list | None) -> bool:
        """Whether this call is one DecoderStep runs: one token per row on a CPU, plain
        KV caches in the model's type, eval mode without autograd (where attention()
        picks the fused kernel for every type), not traced."""
        if caches is None or tgt.shape[1] != 1 or tgt.device.type != "cpu" \
                or self.decoder.training or torch.is_grad_enabled() or torch.jit.is_tracing():
            return False
        dtype = self.decoder.embed.embedding.weight.dtype
        return all(type(cache) is KVCache and cache.k.dtype == dtype for cache in caches)

    def __call__(self, tgt: Tensor, memory_kv: list[tuple[Tensor, Tensor]] | None,
                 memory_mask: Tensor | None, tgt_mask: Tensor | None,
                 caches: list[KVCache], positions: Tensor | None) -> Tensor:
        """tgt (R, 1), each layer's cross-attention keys and values (B, Hkv, S, D) with
        memory_mask (B, 1, 1, S), tgt_mask over every cached key and the new one, caches,
        positions (R, 1) or None -> hidden states (R, 1, C), as Decoder.forward."""
        decoder = self.decoder
        x = decoder.embed.forward(tgt, caches[0].length, positions)        # (R, 1, C)
        self_mask = None if tgt_mask is None else masks.four_d(tgt_mask)
        cross_mask = None if memory_mask is None else masks.four_d(memory_mask)
        for i, layer in enumerate(decoder.layers):
            kv = None if memory_kv is None else memory_kv[i]
            if layer.norm_first:
                x = x + self._self_attention(layer, layer.norm1.forward(x), caches[i], self_mask)
                if layer.cross_attn is not None:
                    x = x + self._cross_attention(layer, layer.norm2.forward(x), kv, cross_mask)
                x = x + _feed_forward(layer.ffn, layer.norm3.forward(x))
            else:
                x = layer.norm1.forward(x + self._self_attention(layer, x, caches[i], self_mask))
                if layer.cross_attn is not None:
                    x = layer.norm2.forward(x + self._cross_attention(layer, x, kv, cross_mask))
                x = layer.norm3.forward(x + _feed_forward(layer.ffn, x))
        return x if decoder.final_norm is None else decoder.final_norm.forward(x)

    def _self_attention(self, layer: nn.Module, h: Tensor, cache: KVCache,
                        mask: Tensor | None) -> Tensor:
        """h (R, 1, C) -> the self-attention sub-layer's output (R, 1, C); the cache
        takes this step's keys and values."""
        attn = layer.self_attn
        q, k, v = attn.qkv_proj.forward(h).split(self.sizes, -1)
        keys, values = cache.update(attn._split(k, self.kv_heads), attn._split(v, self.kv_heads))
        out = F.scaled_dot_product_attention(
            attn._split(q, self.heads), keys, values, attn_mask=mask, dropout_p=0.0,
            is_causal=False, scale=self.scale, enable_gqa=self.kv_heads != self.heads)
        return attn.out_proj.forward(out.transpose(1, 2).flatten(2))

    def _cross_attention(self, layer: nn.Module, h: Tensor, kv: tuple[Tensor, Tensor],
                         mask: Tensor | None) -> Tensor:
        """h (R, 1, C) against the sources' keys and values (B, Hkv, S, D); the n = R / B
        rows of a source (its beams) are folded into one sequence of n queries, as
        MultiHeadAttention._cross_attention does -> (R, 1, C)."""
        attn, (k, v) = layer.cross_attn, kv
        q = attn._split(attn.q_proj.forward(h), self.heads)                 # (R, H, 1, D)
        rows, sources = q.shape[0], k.shape[0]
        n = rows // sources
        if n > 1:
            q = q.unflatten(0, (sources, n)).transpose(1, 2).flatten(2, 3)  # (B, H, n, D)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=self.scale,
            enable_gqa=self.kv_heads != self.heads)
        if n > 1:
            out = out.unflatten(2, (n, 1)).transpose(1, 2).flatten(0, 1)    # (R, H, 1, D)
        return attn.out_proj.forward(out.transpose(1, 2).flatten(2))


def _feed_forward(ffn: nn.Module, h: Tensor) -> Tensor:
    return ffn.linear2.forward(ffn.activation.forward(ffn.linear1.forward(h)))

