"""Label-smoothed cross entropy (Szegedy et al. 2016), as the paper trains with (eps 0.1).

The target distribution puts 1 - eps on the reference token and spreads eps uniformly
over the other tokens of the vocabulary except padding, which is never a target.
Padding positions contribute nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float,
                       pad_id: int) -> tuple[Tensor, Tensor]:
    """logits (B, T, V), target (B, T) -> (smoothed loss, plain NLL), each summed over
    the non-pad target tokens, in float32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)                    # (B, T, V)
    keep = target != pad_id                                                   # (B, T)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)            # (B, T)
    # Mass eps over the V - 2 tokens that are neither the reference nor padding.
    others = -(log_probs.sum(dim=-1) - log_probs[..., pad_id]) - nll
    smoothed = (1.0 - epsilon) * nll + epsilon / (logits.shape[-1] - 2) * others
    return smoothed[keep].sum(), nll[keep].sum()
