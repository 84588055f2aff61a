"""Linear attention (Katharopoulos et al., 2020): softmax(q k^T) is replaced by the kernel
phi(q) phi(k)^T with the positive feature map phi(x) = elu(x) + 1, so that

    out_i = phi(q_i) (sum_j phi(k_j) v_j^T) / (phi(q_i) . sum_j phi(k_j))

and the sums over keys are computed once: time and memory linear in the length. Causal
attention keeps running sums; the decoder's cache is those sums, (D, D) and (D,) per
key/value head, whatever the length.

Shapes as in kernels.py: q (B, H, T, D); k, v (B, H_kv, S, D) with H % H_kv == 0;
key_mask (B, S), True = a real key. q and k are raw projections; phi is applied here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transduce.attention import masks
from transduce.attention.kv_cache import Attended, AttentionCache, refuse_position_bias, \
    refuse_softcap
from transduce.attention.tiles import tiles

# Running sums over the keys seen so far: sum phi(k) v^T (B, Hkv, D, D), sum phi(k) (B, Hkv, D).
LinearState = tuple[Tensor, Tensor]

_EPS = 1e-6


def feature_map(x: Tensor) -> Tensor:
    return F.elu(x) + 1.0


def linear_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None, *,
                     causal: bool = False, state: LinearState | None = None,
                     chunk: int = 64) -> tuple[Tensor, LinearState]:
    """-> out (B, H, T, D), and the sums over every key (the state after these keys).

    causal: query i attends keys 0..i of this call (T == S) plus the keys summed in
    `state`. It runs chunk by chunk: inside a chunk the (chunk x chunk) kernel matrix,
    across chunks the running sums, so memory stays linear in T.
    """
    kv_heads, head_dim = k.shape[1], k.shape[3]
    phi_q = feature_map(q).unflatten(1, (kv_heads, -1))                 # (B, Hkv, G, T, D)
    phi_k = feature_map(k)                                               # (B, Hkv, S, D)
    if key_mask is not None:
        phi_k = phi_k * key_mask[:, None, :, None].to(phi_k.dtype)       # padding adds nothing
    if state is None:
        batch = k.shape[0]
        state = (k.new_zeros(batch, kv_heads, head_dim, v.shape[3]),
                 k.new_zeros(batch, kv_heads, head_dim))
    kv_sum, k_sum = state
    if not causal:
        kv_sum = kv_sum + phi_k.transpose(-1, -2) @ v                     # (B, Hkv, D, Dv)
        k_sum = k_sum + phi_k.sum(dim=2)                                  # (B, Hkv, D)
        out = _normalised(phi_q @ kv_sum.unsqueeze(2), phi_q @ k_sum[:, :, None, :, None])
        return out.flatten(1, 2), (kv_sum, k_sum)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"causal linear attention needs one key per query, got "
                         f"{q.shape[2]} queries and {k.shape[2]} keys")
    outputs = []
    for start, stop in tiles(q.shape[2], chunk):
        q_c, k_c, v_c = phi_q[:, :, :, start:stop], phi_k[:, :, start:stop], v[:, :, start:stop]
        within = (q_c @ k_c.unsqueeze(2).transpose(-1, -2)).tril()      # (B, Hkv, G, c, c)
        numerator = q_c @ kv_sum.unsqueeze(2) + within @ v_c.unsqueeze(2)
        denominator = q_c @ k_sum[:, :, None, :, None] + within.sum(dim=-1, keepdim=True)
        outputs.append(_normalised(numerator, denominator))
        kv_sum = kv_sum + k_c.transpose(-1, -2) @ v_c
        k_sum = k_sum + k_c.sum(dim=2)
    return torch.cat(outputs, dim=3).flatten(1, 2), (kv_sum, k_sum)


def linear_attention_weights(q: Tensor, k: Tensor, key_mask: Tensor | None = None, *,
                             causal: bool = False) -> Tensor:
    """The (T, S) weights that linear attention applies implicitly, written out: the
    quadratic reference, and what attention maps draw. -> (B, H, T, S), rows sum to 1
    (or 0 when a query has no key)."""
    kv_heads = k.shape[1]
    scores = feature_map(q).unflatten(1, (kv_heads, -1)) @ feature_map(k).unsqueeze(2).transpose(-1, -2)
    allowed = masks.combine(None if key_mask is None else key_mask[:, None, None, :],
                            masks.causal_mask(q.shape[2], k.shape[2], device=q.device)
                            if causal else None)
    if allowed is not None:
        scores = scores * masks.group_heads(allowed, kv_heads, -1).to(scores.dtype)
    return _normalised(scores, scores.sum(dim=-1, keepdim=True)).flatten(1, 2)


def _normalised(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator; zero where no key contributed (denominator 0)."""
    return numerator / denominator.clamp_min(_EPS)


class LinearStateCache(AttentionCache):
    """Linear attention's running sums, sum phi(k) v^T (B, Hkv, D, D) and sum phi(k)
    (B, Hkv, D): constant memory, however long the output."""

    _buffers = ("kv_sum", "k_sum")

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.kv_sum = torch.zeros((batch_size, num_kv_heads, head_dim, head_dim), dtype=dtype,
                                  device=device)
        self.k_sum = torch.zeros((batch_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.length = 0

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
               causal: bool, impl: str, return_weights: bool = False,
               position_bias: Tensor | None = None,
               softcap: float | None = None) -> Attended:
        """q (B, H, T, D) over the summed keys and this step's; the sums move past them.
        mask covers every key seen (B, 1, 1, length + T): this step's part of it says
        which new keys enter the sums (a masked key never does)."""
        refuse_position_bias(position_bias, "linear attention")
        refuse_softcap(softcap, "linear attention")
        if return_weights:
            raise ValueError("linear attention's cache keeps sums, not keys: its weights "
                             "exist only in a full (uncached) pass")
        key_mask = masks.key_padding(mask, "linear attention")
        out, (self.kv_sum, self.k_sum) = linear_attention(
            q, k, v, None if key_mask is None else key_mask[:, -k.shape[2]:], causal=causal,
            state=(self.kv_sum, self.k_sum))
        self.length += q.shape[2]
        return out

    def reset(self) -> None:
        self.kv_sum, self.k_sum, self.length = torch.zeros_like(self.kv_sum), \
            torch.zeros_like(self.k_sum), 0
