"""Relative positions as an additive bias on the attention scores: T5's bucketed bias and
ALiBi's linear penalty.

    scores[h, i, j] = q_i . k_j / sqrt(d_k) + b_h(pos(i) - pos(j))

The bias depends only on the distance pos(i) - pos(j), so it travels to the kernels as
one vector per head over the distances a call can see, never as a (T, S) matrix. With the
queries aligned with the last keys (as everywhere here: query t sits at key position
t + S - T), the distances run from 1 - T to S - 1, and

    vector (H, T + S - 1),   vector[h, d + T - 1] = b_h(d).

The kernels add vector[h, t - s + S - 1] to the score of query t and key s. Left padding
shifts a row's query and key positions alike, so distances, and the bias, are unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def distances(num_queries: int, num_keys: int, device: torch.device | str | None = None) -> Tensor:
    """The distances pos(query) - pos(key) a (T, S) call sees, in vector order: (T + S - 1,)."""
    return torch.arange(1 - num_queries, num_keys, device=device)


def expand(vector: Tensor, num_queries: int, num_keys: int) -> Tensor:
    """vector (H, T + S - 1) -> the dense bias (H, T, S) (for the kernels that build one)."""
    query = torch.arange(num_queries, device=vector.device)[:, None]
    key = torch.arange(num_keys, device=vector.device)[None, :]
    return vector[:, query - key + num_keys - 1]


class ALiBi(nn.Module):
    """b_h(d) = -m_h |d|, with head slopes m_h = 2^(-8 (h + 1) / H) (Press et al., 2022;
    for H not a power of two, the slopes of the next lower power and every other slope
    of the next higher, as in the paper's code). No parameters: nothing to learn, which
    is why it extrapolates to lengths never trained on."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def forward(self, num_queries: int, num_keys: int) -> Tensor:
        """-> vector (H, T + S - 1) float32."""
        d = distances(num_queries, num_keys, self.slopes.device).abs().float()
        return -self.slopes[:, None] * d[None, :]


def alibi_slopes(num_heads: int) -> Tensor:
    """(H,) the geometric slopes, 2^-8/n .. 2^-8 for the largest power of two n <= H."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(lower) + geometric(2 * lower)[0::2][:num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class T5Bias(nn.Module):
    """b_h(d) = table[bucket(d), h], learned (Raffel et al., 2020). Buckets: distances
    below num_buckets / 4 (bidirectional; / 2 causal) each get their own, larger ones
    share logarithmically wider buckets up to max_distance, beyond which all share the
    last. Bidirectional (encoders) keeps separate buckets for keys before and after the
    query; causal self-attention sees only keys at or before it."""

    def __init__(self, num_heads: int, *, bidirectional: bool, num_buckets: int = 32,
                 max_distance: int = 128):
        super().__init__()
        self.bidirectional, self.num_buckets, self.max_distance = \
            bidirectional, num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, num_heads)
        nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, num_queries: int, num_keys: int) -> Tensor:
        """-> vector (H, T + S - 1) in the table's dtype."""
        buckets = self.bucket(distances(num_queries, num_keys, self.table.weight.device))
        return self.table(buckets).transpose(0, 1)

    def bucket(self, distance: Tensor) -> Tensor:
        """distance = pos(query) - pos(key), any shape -> bucket ids, same shape."""
        buckets = self.num_buckets
        offset = torch.zeros_like(distance)
        if self.bidirectional:
            buckets //= 2
            offset = (distance < 0).long() * buckets   # keys after the query
            distance = distance.abs()
        else:
            distance = distance.clamp(min=0)           # keys after the query: masked anyway
        exact = buckets // 2
        log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
        far = (exact + (log_ratio * (buckets - exact)).long()).clamp(max=buckets - 1)
        return offset + torch.where(distance < exact, distance, far)
