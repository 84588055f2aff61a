"""The key/value cache of one self-attention layer, for incremental decoding.

Buffers are allocated once for the longest output (no re-allocation per step); update()
writes the new step's keys and values in place and returns views of everything cached.
Its size is the seeds' formula per layer: 2 x kv_heads x head_dim x bytes x tokens x batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values (B, Hkv, max_len, D), filled up to `length`."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the two buffers, measured from the tensors themselves."""
        return self.k.nelement() * self.k.element_size() + self.v.nelement() * self.v.element_size()

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append (B, Hkv, T, D) keys and values -> all cached (B, Hkv, length, D), as views."""
        steps = k_new.shape[2]
        if k_new.shape != v_new.shape or k_new.shape[:2] != self.k.shape[:2] \
                or k_new.shape[3] != self.k.shape[3]:
            raise ValueError(f"cannot append keys {tuple(k_new.shape)} / values "
                             f"{tuple(v_new.shape)} to a cache of shape {tuple(self.k.shape)}")
        end = self.length + steps
        if end > self.max_len:
            raise ValueError(f"KV cache full: {self.length} cached + {steps} new > max_len "
                             f"{self.max_len}")
        self.k[:, :, self.length:end] = k_new
        self.v[:, :, self.length:end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (B',) in that order: beam search's survivors, or the
        sentences still running. Only the filled positions are copied."""
        # One gather of the filled positions into fresh buffers: cheaper than gathering
        # and writing back in place, and it also serves a shrinking batch.
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((index.numel(),) + old.shape[1:])
            torch.index_select(old[:, :, :self.length], 0, index, out=new[:, :, :self.length])
            setattr(self, name, new)

    def reset(self) -> None:
        self.length = 0
