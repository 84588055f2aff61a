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
import torch.nn.functional as F
from torch import Tensor

from transduce.attention import masks
from transduce.attention.kernels import attention
from transduce.attention.local import MIN_BLOCK


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
    batch, heads, length, dim = q.shape
    if k.shape[2] != length:
        raise ValueError(f"sparse attention is self-attention: {length} queries but "
                         f"{k.shape[2]} keys")
    block = max(pattern.window, MIN_BLOCK)
    blocks = -(-length // block)
    padded = blocks * block
    before, after = block, padded - length + (0 if causal else block)
    span = (2 if causal else 3) * block
    extra = pattern.extra_positions(length, q.device)                    # (E,)

    def key_blocks(x: Tensor) -> Tensor:
        """(B, Hkv, T, D) -> (B * n, Hkv, span + E, D): each block's band, then the extra keys."""
        band = F.pad(x, (0, 0, before, after)).unfold(2, span, block).permute(0, 2, 1, 4, 3)
        shared = x[:, :, extra].unsqueeze(1).expand(-1, blocks, -1, -1, -1)
        return torch.cat([band, shared], dim=3).flatten(0, 1)

    q_blocks = F.pad(q, (0, 0, 0, padded - length)).unflatten(2, (blocks, block))
    q_blocks = q_blocks.transpose(1, 2).flatten(0, 1)                    # (B * n, H, b, D)
    valid = q.new_ones(batch, length, dtype=torch.bool) if key_mask is None else key_mask
    band_valid = F.pad(valid, (before, after), value=False).unfold(1, span, block)
    band = masks.band_mask(block, span, pattern.window, causal=causal, query_offset=block,
                           device=q.device)                              # (1, 1, b, span)
    allowed = torch.cat([band & band_valid.flatten(0, 1)[:, None, None, :],
                         _extra_allowed(pattern, extra, blocks, block, causal, valid)], dim=3)
    out = attention(q_blocks, key_blocks(k), key_blocks(v), allowed, impl=impl,
                    dropout_p=dropout_p)                                 # (B * n, H, b, D)
    out = out.unflatten(0, (batch, blocks)).transpose(1, 2).flatten(2, 3)[:, :, :length]
    rows = min(pattern.global_tokens, length)
    if rows:   # global queries see every key (causal: every earlier one)
        full = masks.causal_mask(rows, length, offset=0, device=q.device) if causal else None
        key_part = None if key_mask is None else key_mask[:, None, None, :]
        out = torch.cat([attention(q[:, :, :rows], k, v, masks.combine(full, key_part),
                                   impl=impl, dropout_p=dropout_p), out[:, :, rows:]], dim=2)
    return out


def _extra_allowed(pattern: Pattern, extra: Tensor, blocks: int, block: int, causal: bool,
                   valid: Tensor) -> Tensor:
    """(B * n, 1, b, E): query i may use extra key j when j is a real key outside its
    window (inside it, the band has it already) and, when causal, j <= i."""
    query_pos = torch.arange(blocks * block, device=extra.device).view(blocks, block, 1)
    distance = query_pos - extra.view(1, 1, -1)                         # (n, b, E)
    outside = distance > pattern.window if causal else distance.abs() > pattern.window
    if causal:
        outside &= distance >= 0
    allowed = outside[None] & valid[:, extra][:, None, None, :]          # (B, n, b, E)
    return allowed.flatten(0, 1).unsqueeze(1)
