"""Attention scores of the RNN encoder-decoders that came before the Transformer.

Each module maps a query (the decoder state) and the encoder states to a context vector
and the attention weights over the source:

    additive (Bahdanau):  score(q, k) = v^T tanh(W_q q + W_k k)
    dot (Luong):          score(q, k) = q^T k
    general (Luong):      score(q, k) = q^T W k

Shapes: query (B, T, Dq); keys (B, S, Dk); values (B, S, Dv); mask broadcastable to
(B, T, S), True = may attend -> context (B, T, Dv), weights (B, T, S).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transduce.attention.kernels import masked_softmax


def _attend(scores: Tensor, values: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """scores (B, T, S), values (B, S, Dv) -> context (B, T, Dv), weights (B, T, S)."""
    weights = masked_softmax(scores, mask)
    return weights @ values, weights


class AdditiveAttention(nn.Module):
    """Bahdanau et al. (2015): a one-hidden-layer MLP scores each (query, key) pair.

    The key projection W_k k depends on the source only: `project_keys` computes it once
    per source so that a decoder can pass it to every step.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int):
        super().__init__()
        self.query_proj = nn.Linear(query_dim, hidden_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, hidden_dim, bias=False)
        self.score = nn.Linear(hidden_dim, 1, bias=False)

    def project_keys(self, keys: Tensor) -> Tensor:
        """keys (B, S, Dk) -> (B, S, hidden)."""
        return self.key_proj(keys)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None,
                *, projected_keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if projected_keys is None:
            projected_keys = self.project_keys(keys)
        # (B, T, 1, hidden) + (B, 1, S, hidden) -> (B, T, S, hidden) -> (B, T, S)
        features = torch.tanh(self.query_proj(query).unsqueeze(2) + projected_keys.unsqueeze(1))
        return _attend(self.score(features).squeeze(-1), values, mask)


class DotAttention(nn.Module):
    """Luong et al. (2015), "dot": the query and key must have the same size. No
    parameters; project_keys is the identity, so decoders treat all three alike."""

    @staticmethod
    def project_keys(keys: Tensor) -> Tensor:
        return keys

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None,
                *, projected_keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if query.shape[-1] != keys.shape[-1]:
            raise ValueError(f"dot attention needs equal query and key sizes, got "
                             f"{query.shape[-1]} and {keys.shape[-1]}; use GeneralAttention")
        return _attend(query @ keys.transpose(1, 2), values, mask)


class GeneralAttention(nn.Module):
    """Luong et al. (2015), "general": a learned bilinear form q^T W k.

    W k depends on the source only: `project_keys` computes it once per source."""

    def __init__(self, query_dim: int, key_dim: int):
        super().__init__()
        self.key_proj = nn.Linear(key_dim, query_dim, bias=False)

    def project_keys(self, keys: Tensor) -> Tensor:
        """keys (B, S, Dk) -> W k (B, S, Dq)."""
        return self.key_proj(keys)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None,
                *, projected_keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if projected_keys is None:
            projected_keys = self.project_keys(keys)
        return _attend(query @ projected_keys.transpose(1, 2), values, mask)
