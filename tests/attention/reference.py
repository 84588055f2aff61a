"""An independent float64 attention reference: keys and values repeated per query head,
masks applied with torch.where, fully masked rows set to zero explicitly."""

import math

import torch


def reference_attention(q, k, v, mask=None, causal=False, softcap=None):
    """q (B, H, T, D), k/v (B, Hkv, S, D), mask broadcastable to (B, H, T, S); softcap:
    scores s as softcap * tanh(s / softcap)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    T, S = q.shape[2], k.shape[2]
    allowed = torch.ones(q.shape[0], q.shape[1], T, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        i = torch.arange(T)[:, None]
        j = torch.arange(S)[None, :]
        allowed = allowed & (j <= i + (S - T))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=torch.float64))
    has_key = allowed.any(-1, keepdim=True)
    weights = torch.softmax(torch.where(has_key, scores, torch.zeros_like(scores)), dim=-1)
    weights = torch.where(has_key, weights, torch.zeros_like(weights))
    return weights @ v, weights
