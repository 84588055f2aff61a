"""One decoding step of a decoding copy's decoder, written out operator by operator and
compiled by TorchScript.

A step of a small model is a hundred-odd operators on a few rows. Run from Python, each
costs interpreter and dispatch time around a kernel of a few microseconds, and the
modules add their own (nn.Module's call machinery, attention's input checks and kernel
choice, the cache's shape checks). StepLayers runs the decoder layers' operators in the
modules' order with none of that, and TorchScript runs them from its own interpreter:
no Python between operators. The kernels are the modules' own, called in the same
order: the logits are bit-identical (tested, compiled and not). Steps over row runs (a
continuous search's, below) read them through the one-query kernel where it is built
(attention/one_query.py), equal to float32's last bits. Where TorchScript is
missing or cannot compile a step, the same code runs as Python. (Whether two decoding
workers' compiled steps overlap better than their Python ones is not measured yet.)

It covers the common case (softmax attention over plain KV caches, additive, rotary or
no positions or a relative-position score bias, queries and keys normalized per head
or not, sandwich norms or not, parallel residuals or not, PyTorch's fused attention
kernel, or Gemma 2's soft-capped scores in attention()'s written-out form; a sliding
window's layers too, over plain caches within the window (kinds.py) and past it over
the window's own cache, local.py's SlidingKVCache, one token a row, every held key in
the band; and sliding layers among full ones over a continuous batch's slots, local.py's
BandedKVCache, whose row runs start at the band where it is later) and leaves every
other step to the modules: `covers` says which. A score bias (T5's, ALiBi)
enters the step as SDPA's float mask, built once per step for every layer. A language
model's step may feed a few tokens a row after its prompt (up to MAX_STEP_TOKENS:
prompt lookup's drafts, decode/lookup.py), each attending to the cache and the new
tokens before it.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transduce.attention import masks, one_query
from transduce.attention.kernels import bias_as_mask
from transduce.attention.kv_cache import KVCache
from transduce.attention.local import BandedKVCache, SlidingKVCache
from transduce.attention.multihead import merge_heads, split_heads
from transduce.model.positional import check_range
from transduce.model.scripting import CompiledOnFirstCall, WrittenOut

# The most new tokens a row a step covers after a prompt (a prompt's own pass, however
# short, is the modules'); prompt lookup feeds the pending token and its drafts.
MAX_STEP_TOKENS = 16


def _supported(decoder: nn.Module) -> bool:
    """Whether every layer is one StepLayers writes out: fused self-attention
    projections, scaled scores, the SDPA kernel (or, for self-attention's capped scores
    without a score bias, the written-out form that attention() computes them in)."""
    for layer in decoder.layers:
        attentions = [layer.self_attn] + ([layer.cross_attn] if layer.cross_attn is not None
                                          else [])
        if layer.self_attn.qkv_proj is None:
            return False
        if any(a.impl != "sdpa" or a.query_factor != 1.0 for a in attentions):
            return False
        if layer.self_attn.softcap is not None and decoder.score_bias is not None:
            return False
        if layer.cross_attn is not None and layer.cross_attn.softcap is not None:
            return False
    return True


class FusedSelfAttention(nn.Module):
    """A self-attention module's fused projections and sizes, for the written-out passes
    (this step's and encoder_pass.py's): project, then attend through SDPA."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.qkv_proj, self.out_proj = attn.qkv_proj, attn.out_proj
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, \
            attn.head_dim
        self.sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim,
                      self.kv_heads * self.head_dim]
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.grouped = self.kv_heads != self.heads
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm       # qk_norm's, else None
        self.softcap: Optional[float] = attn.softcap      # Gemma 2's cap on the scores

    def project(self, h: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """h (B, T, C) -> queries (B, H, T, D), keys and values (B, Hkv, T, D)."""
        qkv = self.qkv_proj(h).split(self.sizes, -1)
        q = split_heads(qkv[0], self.heads, self.head_dim)
        k = split_heads(qkv[1], self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, split_heads(qkv[2], self.kv_heads, self.head_dim)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """q (B, H, T, D), k and v (B, Hkv, S, D), mask (B|1, 1, T|1, S) boolean or SDPA's
        float one -> (B, H, T, D)."""
        cap = self.softcap
        if cap is not None:
            return self.capped(q, k, v, mask, cap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                              is_causal=False, scale=self.scale,
                                              enable_gqa=self.grouped)

    def capped(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
               cap: float) -> Tensor:
        """Soft-capped scores, by attention()'s written-out form's operators in its order
        (kernels._naive, masked_softmax), so that the step equals the modules bit for
        bit; mask boolean (the step has no score bias then)."""
        group = self.heads // self.kv_heads
        q5 = q.unflatten(1, (self.kv_heads, group))                      # (B, Hkv, G, T, D)
        scores = (q5 * self.scale) @ k.unsqueeze(2).transpose(-1, -2)   # (B, Hkv, G, T, S)
        scores = torch.tanh(scores / cap) * cap
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v.unsqueeze(2)            # (B, Hkv, G, T, D)
        return out.flatten(1, 2)


class WrittenFeedForward(nn.Module):
    """FeedForward.forward on the module's own layers, for the written-out passes (this
    step's and encoder_pass.py's)."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.linear1, self.activation, self.linear2 = ffn.linear1, ffn.activation, ffn.linear2
        self.linear3 = ffn.linear3          # a gated FFN's, else None

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        hidden = self.activation(self.linear1(x))
        if self.linear3 is not None:
            hidden = hidden * self.linear3(x)
        return self.linear2(hidden)


class _SelfAttention(FusedSelfAttention):
    """Self-attention of one new query per row over the cache, which takes its key and
    value at slot `length`; rotary positions rotate the query and key as RotaryEmbedding
    does, from its tables."""

    def __init__(self, attn: nn.Module):
        super().__init__(attn)
        self.rotary = attn.rotary is not None
        self.rotary_cos = attn.rotary.cos if self.rotary else torch.zeros(0)   # (P, D)
        self.rotary_sin = attn.rotary.sin if self.rotary else torch.zeros(0)

    def forward(self, h: Tensor, k_cache: Tensor, v_cache: Tensor, length: int, kept: int,
                band: int, mask: Optional[Tensor], runs: Optional[List[Tuple[int, int, int]]],
                row_starts: Optional[Tensor], positions: Optional[Tensor]
                ) -> Tuple[Tensor, Tensor, Tensor]:
        """h (R, N, C), caches (R, Hkv, T, D) holding `length` slots -> (R, N, C), and
        the caches after the step. kept > 0: the caches are a sliding window's (local.py's
        SlidingKVCache), holding the keys before this step's within the window: they
        become the last `kept` of those and this step's (N is 1, see covers), as
        SlidingKVCache.update keeps them.
        runs: (first row, end row, first slot) of row ranges that read only the slots
        from their first on (then mask is None; N is 1); row_starts (R,): each row's
        first slot, the same given per row; band > 0, with runs: the layer attends to
        the last `band` keys before the query and its own (local.py's BandedKVCache),
        from a row's first slot or the band's, whichever is later; positions (R, N):
        each token's rotary position (None: from `length` on for all)."""
        q, k, v = self.project(h)                         # (R, H, N, D), (R, Hkv, N, D) x 2
        if self.rotary:
            q, k = self.rotate(q, length, positions), self.rotate(k, length, positions)
        if kept > 0:
            k_all, v_all = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
            out = self.attend(q, k_all, v_all, _window_mask(mask, k_all.shape[2]))
            return self.out_proj(merge_heads(out)), k_all[:, :, -kept:], v_all[:, :, -kept:]
        end = length + h.shape[1]
        k_cache[:, :, length:end] = k
        v_cache[:, :, length:end] = v
        if runs is None:
            out = self.attend(q, k_cache[:, :, :end], v_cache[:, :, :end], mask)
        else:
            out = self.attend_runs(q, k_cache, v_cache, end, runs, row_starts, band)
        return self.out_proj(merge_heads(out)), k_cache, v_cache

    def rotate(self, x: Tensor, length: int, positions: Optional[Tensor]) -> Tensor:
        """RotaryEmbedding.forward's operators: x (R, H, N, D) at positions from `length`
        on, or at `positions` (R, N) -> (R, H, N, D)."""
        if positions is None:
            end = length + x.shape[2]
            cos, sin = self.rotary_cos[length:end], self.rotary_sin[length:end]   # (N, D)
        else:
            cos, sin = self.rotary_cos[positions].unsqueeze(1), \
                self.rotary_sin[positions].unsqueeze(1)                      # (R, 1, N, D)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    def attend_runs(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, end: int,
                    runs: List[Tuple[int, int, int]], row_starts: Optional[Tensor],
                    band: int) -> Tensor:
        """One unmasked call of PyTorch's kernel per run, over its slots from its first
        or the band's (band > 0), whichever is later -> (R, H, 1, D)."""
        lowest = end - 1 - band if band > 0 else 0
        out: List[Tensor] = []
        for first, last, start in runs:
            start = max(start, lowest)
            out.append(self.attend(q[first:last], k_cache[first:last, :, start:end],
                                   v_cache[first:last, :, start:end], None))
        return torch.cat(out)


def _window_mask(mask: Optional[Tensor], keys: int) -> Tensor:
    """The mask SlidingKVCache.attend gives the kernel for one query over `keys` held
    ones, all within its band: the step's key mask over its last `keys` slots, or the
    band itself (every key allowed), so that the kernel runs as it does there."""
    if mask is None:
        return torch.ones(1, 1, 1, keys, dtype=torch.bool)
    return mask[:, :, :, mask.shape[3] - keys:]


class _KernelSelfAttention(_SelfAttention):
    """_SelfAttention whose runs are read by one call of the one-query kernel
    (attention/one_query.py): each row its own slots, whatever the runs."""

    def attend_runs(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, end: int,
                    runs: List[Tuple[int, int, int]], row_starts: Optional[Tensor],
                    band: int) -> Tensor:
        assert row_starts is not None, "the kernel reads each row's first slot"
        if band > 0:                             # from the band's first slot where later
            row_starts = row_starts.clamp(min=end - 1 - band)
        rows = q.shape[0]
        grouped = q.view(rows, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        ends = torch.full_like(row_starts, end)
        out = torch.ops.transduce.one_query_attention(grouped, k_cache, v_cache, row_starts,
                                                      ends, self.scale)
        return out.view(rows, self.heads, 1, self.head_dim)


class _CrossAttention(nn.Module):
    """Cross-attention of one query per row against its source's keys and values; the
    n = R / B rows of a source (its beams) are folded into one sequence of n queries, as
    MultiHeadAttention._cross_attention does."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.q_proj, self.out_proj, self.q_norm = attn.q_proj, attn.out_proj, attn.q_norm
        self.heads, self.head_dim = attn.num_heads, attn.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.grouped = attn.num_kv_heads != attn.num_heads

    def forward(self, h: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                lengths: Optional[Tensor]) -> Tensor:
        """h (R, 1, C), k and v (B, Hkv, S, D), mask (B, 1, 1, S) -> (R, 1, C).
        lengths (B,): each source's keys are its first `length` (the mask's, given
        again; used by the kernel's subclass)."""
        q = split_heads(self.q_proj(h), self.heads, self.head_dim)          # (R, H, 1, D)
        if self.q_norm is not None:     # the keys were normalized by project_kv
            q = self.q_norm(q)
        n = q.shape[0] // k.shape[0]
        if n > 1:
            q = q.unflatten(0, (k.shape[0], n)).transpose(1, 2).flatten(2, 3)  # (B, H, n, D)
        out = self.attend(q, k, v, mask, lengths)                           # (B, H, n, D)
        if n > 1:
            out = out.unflatten(2, (n, 1)).transpose(1, 2).flatten(0, 1)    # (R, H, 1, D)
        return self.out_proj(merge_heads(out))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
               lengths: Optional[Tensor]) -> Tensor:
        return self.sdpa(q, k, v, mask)

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=self.scale,
            enable_gqa=self.grouped)


class _KernelCrossAttention(_CrossAttention):
    """_CrossAttention through the one-query kernel where the sources' lengths are given:
    each source's queries (its beams, and a kv head's group) read its own keys only, not
    the padding up to the widest source."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
               lengths: Optional[Tensor]) -> Tensor:
        if lengths is None:
            return self.sdpa(q, k, v, mask)
        sources, heads, n, dim = q.shape
        grouped = q.reshape(sources, k.shape[1], heads // k.shape[1] * n, dim)
        out = torch.ops.transduce.one_query_attention(grouped, k, v, torch.zeros_like(lengths),
                                                      lengths, self.scale)
        return out.view(sources, heads, n, dim)


class _LayerStep(nn.Module):
    """DecoderLayer.forward for the new tokens of each row, in eval mode (no dropout)."""

    def __init__(self, layer: nn.Module, kernel: bool):
        super().__init__()
        self.norm_first, self.parallel = layer.norm_first, layer.parallel
        self.shared_norm = layer.shared_norm
        self.norm1, self.norm2, self.norm3 = layer.norm1, layer.norm2, layer.norm3
        # the one-query kernel has no cap: a capped layer's runs are calls of their own
        by_kernel = kernel and layer.self_attn.softcap is None
        self.self_attention = (_KernelSelfAttention if by_kernel else _SelfAttention)(
            layer.self_attn)
        self.cross_attention = None if layer.cross_attn is None else \
            (_KernelCrossAttention if kernel else _CrossAttention)(layer.cross_attn)
        self.feed_forward = WrittenFeedForward(layer.ffn)
        # Sandwich norms on the sub-layers' outputs (Gemma's); Identity where there are
        # none, which TorchScript can call (a None it cannot), behind a constant test.
        self.sandwich = layer.post_norm1 is not None
        self.post_norm1, self.post_norm2, self.post_norm3 = (
            nn.Identity() if norm is None else norm
            for norm in (layer.post_norm1, layer.post_norm2, layer.post_norm3))

    def forward(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, length: int, kept: int,
                band: int, self_mask: Optional[Tensor], memory_k: Tensor, memory_v: Tensor,
                cross_mask: Optional[Tensor], runs: Optional[List[Tuple[int, int, int]]],
                row_starts: Optional[Tensor], memory_lengths: Optional[Tensor],
                positions: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        """x (R, N, C) -> (R, N, C), and the caches after the step (_SelfAttention's);
        memory_k and memory_v are empty without cross-attention (N is 1 with it)."""
        # norm2 is None exactly when cross_attention is; TorchScript needs both tested.
        if self.parallel:        # the attention and the FFN over the same input
            normed = self.norm1(x)
            h, k_cache, v_cache = self.self_attention(normed, k_cache, v_cache, length,
                                                      kept, band, self_mask, runs, row_starts,
                                                      positions)
            ffn_input = normed if self.shared_norm else self.norm3(x)
            return x + h + self.feed_forward(ffn_input), k_cache, v_cache
        if self.norm_first:
            h, k_cache, v_cache = self.self_attention(self.norm1(x), k_cache, v_cache, length,
                                                      kept, band, self_mask, runs, row_starts,
                                                      positions)
            x = x + (self.post_norm1(h) if self.sandwich else h)
            if self.cross_attention is not None and self.norm2 is not None:
                h = self.cross_attention(self.norm2(x), memory_k, memory_v, cross_mask,
                                         memory_lengths)
                x = x + (self.post_norm2(h) if self.sandwich else h)
            h = self.feed_forward(self.norm3(x))
            return x + (self.post_norm3(h) if self.sandwich else h), k_cache, v_cache
        h, k_cache, v_cache = self.self_attention(x, k_cache, v_cache, length, kept, band,
                                                  self_mask, runs, row_starts, positions)
        x = self.norm1(x + h)
        if self.cross_attention is not None and self.norm2 is not None:
            x = self.norm2(x + self.cross_attention(x, memory_k, memory_v, cross_mask,
                                                    memory_lengths))
        return self.norm3(x + self.feed_forward(x)), k_cache, v_cache


class StepLayers(nn.Module):
    """The decoder's layers and final norm for the new tokens of each row over KV caches;
    the modules it holds are the decoder's own (no weight is copied)."""

    def __init__(self, decoder: nn.Module, kernel: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(_LayerStep(layer, kernel) for layer in decoder.layers)
        self.final_norm = decoder.final_norm

    def forward(self, x: Tensor, k_caches: List[Tensor], v_caches: List[Tensor], length: int,
                kept: List[int], bands: List[int], self_mask: Optional[Tensor],
                memory_k: List[Tensor],
                memory_v: List[Tensor], cross_mask: Optional[Tensor],
                runs: Optional[List[Tuple[int, int, int]]], row_starts: Optional[Tensor],
                memory_lengths: Optional[Tensor], positions: Optional[Tensor]
                ) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
        """x (R, N, C) embedded tokens, per layer its caches (R, Hkv, T, D) holding `length`
        slots (or, kept > 0, a sliding window's held keys; bands > 0, a band of them read
        by row runs: _SelfAttention) and its
        sources' keys and values (B, Hkv, S, D) (empty tensors without cross-attention),
        positions (R, N) each token's rotary position or None -> hidden states (R, N, C)
        and each layer's caches after the step: a plain cache takes slots `length` to
        `length + N - 1` in place, a window's are new tensors."""
        k_after, v_after = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, k_caches[i], v_caches[i], length, kept[i], bands[i], self_mask,
                            memory_k[i], memory_v[i], cross_mask, runs, row_starts,
                            memory_lengths, positions)
            k_after.append(k)
            v_after.append(v)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, k_after, v_after


class DecoderStep(WrittenOut):
    """Decoder.forward for the new tokens of each row over KV caches (see the module note).
    Built by decoding copies (model/packed.py) for decoders it supports (`build`); the
    layers are compiled on the first step (`script=False` keeps them Python)."""

    def __init__(self, decoder: nn.Module, script: bool = True, kernel: bool | None = None):
        """kernel: whether steps with row runs over float32 caches read them through the
        one-query kernel (attention/one_query.py); None: where it is available, checked
        (and built) at the first such step, so that searches without runs never build
        it."""
        self.decoder, self.script, self.kernel = decoder, script, kernel
        self.layers = CompiledOnFirstCall(StepLayers(decoder), script)
        self._run_layers: CompiledOnFirstCall | None = None
        self._no_memory = torch.zeros(0)

    supports = staticmethod(_supported)

    def covers(self, tgt: Tensor, caches: list | None, runs: bool = False) -> bool:
        """Whether this call is one DecoderStep runs: on a CPU, plain KV caches in the
        model's type, eval mode without autograd (where attention() picks the fused
        kernel for every type), not traced; one token per row, or up to MAX_STEP_TOKENS
        after a prompt where there is no cross-attention or score bias (a prompt's own
        pass is left to the modules). runs: the call reads row runs (then a banded
        cache, one token a row, is one too)."""
        if caches is None or tgt.device.type != "cpu" \
                or self.decoder.training or torch.is_grad_enabled() or torch.jit.is_tracing():
            return False
        if tgt.shape[1] != 1 and not (
                tgt.shape[1] <= MAX_STEP_TOKENS and caches[0].length > 0
                and self.decoder.score_bias is None
                and self.decoder.layers[0].cross_attn is None):
            return False
        dtype = self.decoder.embed.embedding.weight.dtype
        return all((type(cache) is KVCache or self._window_covered(cache, tgt)
                    or runs and self._band_covered(cache, tgt))
                   and cache.k.dtype == dtype for cache in caches)

    def _window_covered(self, cache, tgt: Tensor) -> bool:
        """A sliding window's cache (past the window: kinds.py gives plain caches within
        it) whose held keys and the one new token's are all in its band, so that no band
        mask is needed: one token a row, at most the window held (keys kept for a rewind
        beyond it would fall out of the band), no score bias."""
        return type(cache) is SlidingKVCache and tgt.shape[1] == 1 \
            and cache.held <= cache.window and self.decoder.score_bias is None

    def _band_covered(self, cache, tgt: Tensor) -> bool:
        """A sliding layer's cache among full ones (BandedKVCache), read by row runs,
        which each start at the band where it is later than their first slot."""
        return type(cache) is BandedKVCache and tgt.shape[1] == 1 \
            and self.decoder.score_bias is None

    def __call__(self, tgt: Tensor, memory_kv: list[tuple[Tensor, Tensor]] | None,
                 memory_mask: Tensor | None, tgt_mask: Tensor | None,
                 caches: list[KVCache], positions: Tensor | None,
                 row_runs: list[tuple[int, int, int]] | None = None,
                 memory_lengths: Tensor | None = None) -> Tensor:
        """tgt (R, N), each layer's cross-attention keys and values (B, Hkv, S, D) with
        memory_mask (B, 1, 1, S), tgt_mask over every cached key and the new ones, caches,
        positions (R, N) or None -> hidden states (R, N, C), as Decoder.forward; each
        new token attends to the cache and the new tokens up to itself (N > 1: see
        covers).
        row_runs, instead of tgt_mask: (first row, end row, first slot) of runs of rows
        that cover all R in order, each attending to its slots from its first on only
        (a continuous search's sentences that joined at different steps): one call of
        the one-query kernel reads every row's own slots, or, without it, each run makes
        a self-attention call of its own, without a mask. memory_lengths (B,), with
        row_runs: the sources are right-padded, each its first `length` keys (as
        memory_mask says), which the kernel's cross-attention reads alone."""
        if row_runs is not None and tgt_mask is not None:
            raise ValueError("row_runs replace tgt_mask: give one of them")
        length, new = caches[0].length, tgt.shape[1]
        _check_room(caches, length, new)
        rotary = self.decoder.layers[0].self_attn.rotary
        if rotary is not None:      # every position read is below the next slot's
            check_range(length, new, rotary.max_positions)
        x = self.decoder.embed.forward(tgt, length, positions)             # (R, N, C)
        none = [self._no_memory] * len(caches)
        memory_k = none if memory_kv is None else [k for k, _ in memory_kv]
        memory_v = none if memory_kv is None else [v for _, v in memory_kv]
        layers, row_starts = self.layers, None
        self_mask = None if tgt_mask is None else masks.four_d(tgt_mask)
        if new > 1:                 # each new token sees the cache and the new ones before it
            causal = masks.causal_mask(new, length + new, device=tgt.device)
            self_mask = causal if self_mask is None else self_mask & causal
        if self.decoder.score_bias is not None:
            self_mask, row_runs = _biased_mask(self.decoder.score_bias, length + 1, self_mask,
                                               row_runs, x.dtype), None
        if row_runs is not None:
            layers, row_starts = self._layers_for_runs(x.dtype), _row_starts(row_runs)
        kept = [cache.window + cache.rewindable if type(cache) is SlidingKVCache else 0
                for cache in caches]
        if row_runs is not None and any(kept):
            raise ValueError("row runs read plain caches' slots; these layers hold a window")
        bands = [cache.window if type(cache) is BandedKVCache else 0 for cache in caches]
        if row_runs is None and any(bands):
            raise ValueError("a banded cache's band is read by row runs: give them")
        hidden, k_after, v_after = layers(
            x, [cache.k for cache in caches], [cache.v for cache in caches], length, kept,
            bands, self_mask, memory_k, memory_v,
            None if memory_mask is None else masks.four_d(memory_mask),
            row_runs, row_starts, memory_lengths, positions)
        for cache, k, v in zip(caches, k_after, v_after):
            cache.k, cache.v = k, v
            cache.length = length + new
        return hidden

    def reads_rows_by_kernel(self, dtype: torch.dtype) -> bool:
        """Whether steps over row runs of `dtype` go through the one-query kernel (it reads
        float32 caches only), which reads each row's slots in one call whatever the runs
        (without it, each run is a call of its own)."""
        if dtype != torch.float32:
            return False
        if self.kernel is None:
            self.kernel = one_query.available()
        return self.kernel

    def _layers_for_runs(self, dtype: torch.dtype) -> CompiledOnFirstCall:
        """The layers that read row runs: through the kernel where it is available."""
        if not self.reads_rows_by_kernel(dtype):
            return self.layers
        if self._run_layers is None:
            self._run_layers = CompiledOnFirstCall(StepLayers(self.decoder, kernel=True),
                                                   self.script)
        return self._run_layers


def _biased_mask(score_bias: nn.Module, keys: int, mask: Tensor | None,
                 runs: list[tuple[int, int, int]] | None, dtype: torch.dtype) -> Tensor:
    """The self-attention mask of a step under a relative-position bias: the new query's
    bias over the `keys` slots, as SDPA's float mask (1 or R, H, 1, keys), masked where
    `mask` (R, 1, 1, keys) or the row runs (each row from its first slot on) exclude a
    slot. Runs become this mask: the one-query kernel adds no bias."""
    if runs is not None:
        mask = (torch.arange(keys) >= _row_starts(runs)[:, None])[:, None, None, :]
    return bias_as_mask(score_bias(1, keys), mask, 1, keys, dtype)


def _row_starts(runs: list[tuple[int, int, int]]) -> Tensor:
    """Runs (first row, end row, first slot) -> each row's first slot (R,) int64."""
    return torch.tensor([start for first, last, start in runs for _ in range(last - first)])


def _check_room(caches: list, length: int, new: int = 1) -> None:
    """KVCache.update's refusal of a step with no room left, checked before the compiled
    layers write every cache from slot `length` on (so all must hold that many)."""
    for cache in caches:
        if cache.length != length or cache.k.shape[0] != caches[0].k.shape[0]:
            raise ValueError(f"the decoder's caches disagree: {cache.length} cached, "
                             f"{tuple(cache.k.shape)}, against {length}, "
                             f"{tuple(caches[0].k.shape)}")
        if cache.max_len is not None and length + new > cache.max_len:
            raise ValueError(f"KV cache full: {length} cached + {new} new > max_len "
                             f"{cache.max_len}")
