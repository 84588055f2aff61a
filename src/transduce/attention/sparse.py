"""Sparse attention patterns on the block kernel: a sliding window plus keys every query
shares.

    global  (Longformer, BigBird): the first g tokens are global. Every query attends its
            window and the g global keys; the g global queries attend every key.
    strided (Sparse Transformer's "fixed" pattern): every query attends its window and
            the summary keys at positions s - 1, 2s - 1, ... (stride s = the window).

Both are a band plus a set of extra key positions E shared by all queries. The band goes
through local.py's blocks; each query block gets the extra keys appended to its own
(b x (3b + |E|) scores instead of b x T), with the extra keys that already lie in a
query's window masked out of the appended part so that no key is counted twice. Global
queries are then recomputed over every key. Time and memory: T (3b + |E|), plus g T for
the global rows; |E| = g for global, T / s for strided.

Shapes: q (B, H, T, D); k, v (B, H_kv, T, D) (self-attention); key_mask (B, T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from transduce.attention import masks
from transduce.attention.kernels import attention
from transduce.attention.local import Blocks


@dataclass(frozen=True)
class Pattern:
    """A window of `window` positions either side (before only, when causal) plus the
    extra keys: the first `global_tokens` (also global queries), or every `stride`-th."""
    window: int
    global_tokens: int = 0
    stride: int = 0

    def extra_positions(self, length: int, device: torch.device | str | None = None) -> Tensor:
        """(E,) the shared key positions of a length-T sequence."""
        if self.stride:
            return torch.arange(self.stride - 1, max(length, self.stride - 1), self.stride,
                                device=device)
        return torch.arange(min(self.global_tokens, length), device=device)

    def mask(self, num_queries: int, num_keys: int, *, causal: bool, query_offset: int = 0,
             device: torch.device | str | None = None) -> Tensor:
        """The dense pattern (1, 1, T, S): the reference, and what cached steps use."""
        allowed = masks.band_mask(num_queries, num_keys, self.window, causal=False,
                                  query_offset=query_offset, device=device)
        extra = torch.zeros(num_keys, dtype=torch.bool, device=device)
        extra[self.extra_positions(num_keys, device)] = True
        allowed = allowed | extra
        if self.global_tokens:
            query_pos = torch.arange(num_queries, device=device) + query_offset
            allowed = allowed | (query_pos < self.global_tokens)[None, None, :, None]
        if causal:
            allowed = allowed & masks.causal_mask(num_queries, num_keys,
                                                  offset=query_offset, device=device)
        return allowed


def pattern_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None,
                      pattern: Pattern, *, causal: bool, impl: str = "sdpa",
                      dropout_p: float = 0.0) -> Tensor:
    """-> out (B, H, T, D), equal to attention() with pattern.mask over the full length."""
    blocks = Blocks.of(q, k, pattern.window, causal)
    extra = pattern.extra_positions(blocks.length, q.device)            # (E,)

    def keys(x: Tensor) -> Tensor:
        """(B, Hkv, T, D) -> (B * n, Hkv, span + E, D): each block's band, then the extra keys."""
        shared = x[:, :, extra].unsqueeze(1).expand(-1, blocks.count, -1, -1, -1)
        return torch.cat([blocks.keys(x), shared.flatten(0, 1)], dim=2)

    valid = key_mask if key_mask is not None else \
        torch.ones(blocks.batch, blocks.length, dtype=torch.bool, device=q.device)
    allowed = torch.cat([blocks.band_allowed(key_mask),
                         _extra_allowed(pattern, extra, blocks, valid)], dim=3)
    out = blocks.unblock(attention(blocks.queries(q), keys(k), keys(v), allowed, impl=impl,
                                   dropout_p=dropout_p))                # (B, H, T, D)
    length = blocks.length
    rows = min(pattern.global_tokens, length)
    if rows:   # global queries see every key (causal: every earlier one)
        full = masks.causal_mask(rows, length, offset=0, device=q.device) if causal else None
        key_part = None if key_mask is None else key_mask[:, None, None, :]
        out = torch.cat([attention(q[:, :, :rows], k, v, masks.combine(full, key_part),
                                   impl=impl, dropout_p=dropout_p), out[:, :, rows:]], dim=2)
    return out


def _extra_allowed(pattern: Pattern, extra: Tensor, blocks: Blocks, valid: Tensor) -> Tensor:
    """(B * n, 1, b, E): query i may use extra key j when j is a real key outside its
    window (inside it, the band has it already) and, when causal, j <= i."""
    query_pos = torch.arange(blocks.count * blocks.block, device=extra.device)
    distance = query_pos.view(blocks.count, blocks.block, 1) - extra.view(1, 1, -1)  # (n, b, E)
    outside = distance > pattern.window if blocks.causal else distance.abs() > pattern.window
    if blocks.causal:
        outside &= distance >= 0
    allowed = outside[None] & valid[:, extra][:, None, None, :]          # (B, n, b, E)
    return allowed.flatten(0, 1).unsqueeze(1)
