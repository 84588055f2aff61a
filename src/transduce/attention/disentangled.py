"""DeBERTa's disentangled attention (He et al. 2021): each token is a content vector and,
seen from each other token, a relative position, and a score adds to content-to-content
the content-to-position and position-to-content terms:

    score(i, j) = (q_i . k_j + q_i . kr[d(i, j)] + k_j . qr[d(i, j)]) / sqrt(3 D)

r is a table of 2k position vectors that every layer shares (after a norm of its own);
kr and qr are r through the layer's own key and query projections (DeBERTa-v3's
share_att_key), and d(i, j) is i - j in buckets: exact up to k/2 either side, then
logarithmically wider up to max_distance, clamped to the table (DeBERTa-v3: k = 256,
max_distance 512). No position enters the embeddings.

The two position terms depend on the content, so they reach the kernels as a dense
(B, H, T, S) score bias (kernels.attention's score_bias), which only the written-out
kernels, naive and sdpa, take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def log_buckets(distance: Tensor, buckets: int, max_distance: int) -> Tensor:
    """distance = pos(query) - pos(key), integers of any shape -> the signed bucket of
    each, same shape: the distance itself within buckets / 2, beyond it
    sign * (k/2 + ceil(log(|d| / (k/2)) / log((max_distance - 1) / (k/2)) * (k/2 - 1)))
    (DeBERTa's make_log_bucket_position, in float32 as DeBERTa computes it)."""
    middle = buckets // 2
    magnitude = distance.abs()
    far = magnitude.clamp(min=middle).float()          # the near ones take their distance
    ratio = torch.full((), (max_distance - 1) / middle, dtype=torch.float32)
    scaled = torch.ceil(torch.log(far / middle) / torch.log(ratio) * (middle - 1)) + middle
    return torch.where(magnitude <= middle, distance, (scaled * distance.sign()).long())


def rows_reached(length, buckets: int, max_distance: int):
    """How many rows of the table a pass over `length` tokens (positions 0 .. T - 1)
    reads: 2T - 1 within the exact buckets, at most 2k. length: an int, or a NumPy array
    of them (-> an array)."""
    far = log_buckets(torch.as_tensor(length) - 1, buckets, max_distance)
    rows = (far + buckets).clamp(max=2 * buckets - 1) - (buckets - far).clamp(min=0) + 1
    return rows.numpy() if rows.dim() else int(rows)


@dataclass(frozen=True)
class RelativePositions:
    """What every layer's disentangled attention reads in one pass: the normalized table
    (R, C), its rows the pass reaches (R <= 2k), and each score's row of it, index
    (T, S), or (B, T, S) for rows whose tokens carry positions of their own (packed
    rows)."""

    table: Tensor
    index: Tensor
    dropout: float = 0.0      # on the table, in each layer (DeBERTa's pos_dropout)


class DisentangledPositions(nn.Module):
    """The table of relative position vectors an encoder's layers share, its norm, and
    the buckets of a pass's distances."""

    def __init__(self, d_model: int, buckets: int, max_distance: int, norm: nn.Module,
                 dropout: float = 0.0):
        super().__init__()
        self.buckets, self.max_distance, self.dropout = buckets, max_distance, dropout
        self.embedding = nn.Embedding(2 * buckets, d_model)
        self.norm = norm

    def forward(self, length: int, positions: Tensor | None = None) -> RelativePositions:
        """A pass over `length` tokens at positions 0 .. length - 1, or at each token's
        own positions (B, T)."""
        if positions is None:
            where = torch.arange(length, device=self.embedding.weight.device)
            distance = where[:, None] - where[None, :]                          # (T, T)
        else:
            distance = positions[:, :, None] - positions[:, None, :]            # (B, T, T)
        index = (log_buckets(distance, self.buckets, self.max_distance)
                 + self.buckets).clamp(0, 2 * self.buckets - 1)
        rows = self.embedding.weight                                            # (2k, C)
        # Only the rows the pass reaches (2T - 1 for T tokens within the exact buckets),
        # so that the products with the table shrink with them; traced (an ONNX export)
        # as a range of the index's values, so the graph reaches as its input does;
        # compiled, the whole table (a size read from the data would break the graph).
        if not torch.compiler.is_compiling():
            first = index.min()
            rows = rows.index_select(0, torch.arange(first, index.max() + 1,
                                                     device=rows.device))
            index = index - first
        return RelativePositions(self.norm(rows), index, self.dropout if self.training else 0.0)


def disentangled_bias(q: Tensor, k: Tensor, query_table: Tensor, key_table: Tensor,
                      index: Tensor) -> Tensor:
    """The content-to-position and position-to-content terms, unscaled:
    bias[b, h, i, j] = q[b, h, i] . key_table[h, index[i, j]]
                       + k[b, h, j] . query_table[h, index[i, j]].

    q (B, H, T, D), k (B, H, S, D), the tables (H, R, D), index (T, S) or (B, T, S)
    -> (B, H, T, S)."""
    batch, heads, num_queries, _ = q.shape
    num_keys = k.shape[2]
    if index.dim() == 2:
        index = index[None]
    index = index[:, None].expand(batch, heads, num_queries, num_keys)     # (B, H, T, S)
    to_positions = against_table(q, key_table)                              # (B, H, T, R)
    from_positions = against_table(k, query_table)                          # (B, H, S, R)
    return to_positions.gather(-1, index) + \
        from_positions.gather(-1, index.transpose(-1, -2)).transpose(-1, -2)


def against_table(x: Tensor, table: Tensor) -> Tensor:
    """Each head's vectors against its table: x (B, H, T, D), table (H, R, D) ->
    (B, H, T, R), as one product per head over all B * T vectors (a broadcast matmul
    would copy the table B times first: 1.8x slower at B 64, T 64, deberta-v3-base)."""
    batch, heads, length, dim = x.shape
    flat = x.transpose(0, 1).reshape(heads, batch * length, dim)             # (H, B*T, D)
    products = flat @ table.transpose(-1, -2)                               # (H, B*T, R)
    return products.view(heads, batch, length, table.shape[1]).transpose(0, 1)


def dropped_table(relative: RelativePositions) -> Tensor:
    """The table through its dropout, drawn anew by each layer that reads it: (R, C)."""
    if relative.dropout == 0.0:
        return relative.table
    return F.dropout(relative.table, p=relative.dropout)
