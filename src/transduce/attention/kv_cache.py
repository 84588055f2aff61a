"""The caches of one self-attention layer, for incremental decoding.

    KVCache           keys and values of every past token (softmax attention). Buffers
                      are allocated once for the longest output; update() writes in
                      place and returns views. Size, by the seeds' formula per layer:
                      2 x kv_heads x head_dim x bytes x tokens x batch.
    QuantizedKVCache  the same in int8, one float scale per token and head: about 4x
                      smaller than float32 (plus the scales).
    SlidingKVCache    only the last `window` keys and values (sliding-window attention).
    LinearStateCache  linear attention's running sums, whatever the length.

All have `length` (tokens seen), `nbytes` (from their tensors' sizes; a sliding cache
counts its full window), reorder(index) (beam survivors, running sentences) and reset().
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

    _buffers = ("k", "v")   # (B, Hkv, max_len, X) tensors that reorder() rearranges

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
        """Append (B, Hkv, T, D) keys and values (cast to the cache's type) -> all cached
        (B, Hkv, length, D), as views."""
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
        sentences still running. Only the filled positions of rows that move are copied."""
        for name in self._buffers:
            setattr(self, name, keep_rows(getattr(self, name), index, self.length))

    def reset(self) -> None:
        self.length = 0


class QuantizedKVCache(KVCache):
    """Keys and values stored as int8 with a symmetric scale per (token, head):
    x ~ scale * round(x / scale), scale = max|x| / 127 over the head's D values.
    update() returns the dequantized keys and values in the dtype they arrived in."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 device: torch.device | str | None = None):
        super().__init__(batch_size, num_kv_heads, max_len, head_dim, dtype=torch.int8,
                         device=device)
        scale_shape = (batch_size, num_kv_heads, max_len, 1)
        self.k_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.nelement() * t.element_size()
                                    for t in (self.k_scale, self.v_scale))

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        start, dtype = self.length, k_new.dtype
        k_int, k_scale = quantize_int8(k_new)
        v_int, v_scale = quantize_int8(v_new)
        super().update(k_int, v_int)
        self.k_scale[:, :, start:self.length] = k_scale
        self.v_scale[:, :, start:self.length] = v_scale
        end = self.length
        return (self.k[:, :, :end].to(dtype) * self.k_scale[:, :, :end].to(dtype),
                self.v[:, :, :end].to(dtype) * self.v_scale[:, :, :end].to(dtype))

    _buffers = ("k", "v", "k_scale", "v_scale")


def keep_rows(x: Tensor, index: Tensor, length: int | None = None) -> Tensor:
    """x.index_select(0, index) for x (B, ...), computed by rearranging x's rows in place
    where that is cheaper: a row i with index[i] == i stays where it is, and only the
    other rows are copied, over positions [:length] of dim 2 (all when None). x's first
    B' rows are then the result. Beam search keeps most beams in their rows and moves the
    last sentences into the places of finished ones, so a step copies a few rows instead
    of the whole cache. When many rows move, one gather into a fresh buffer is cheaper.
    """
    rows = index.numel()
    filled = (lambda t: t) if length is None else (lambda t: t[:, :, :length])
    if rows <= x.shape[0]:
        moved = (index != torch.arange(rows, device=index.device)).nonzero().squeeze(1)
        # Copying a moved row in place costs about 2.5x its share of a whole gather
        # (index_copy_ after index_select, measured on CPU): worth it below 40% moved.
        if 5 * moved.numel() <= 2 * rows:
            if moved.numel():
                target = filled(x)
                target.index_copy_(0, moved, target.index_select(0, index[moved]))
            return x[:rows]
    new = x.new_empty((rows,) + x.shape[1:])
    torch.index_select(filled(x), 0, index, out=filled(new))
    return new


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(..., D) -> int8 values (..., D) and float32 scales (..., 1), per vector."""
    scale = x.detach().float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


class SlidingKVCache:
    """The last `window` keys and values: all a sliding-window decoder step can attend
    to besides its own key. Memory stays (B, Hkv, window, D) however long the output."""

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (batch_size, num_kv_heads, 0, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.window = window
        self.length = 0
        self._capacity = (batch_size, num_kv_heads, window, head_dim, dtype)

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        """The bytes of a full window (what the cache holds once window tokens are in)."""
        batch, heads, window, dim, dtype = self._capacity
        return 2 * batch * heads * window * dim * torch.empty((), dtype=dtype).element_size()

    @property
    def held(self) -> int:
        """Keys held now (at most window)."""
        return self.k.shape[2]

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append (B, Hkv, T, D) -> the held keys and values followed by the new ones
        (B, Hkv, held + T, D); the first of them sits at position length - held."""
        k_all = torch.cat([self.k, k_new], dim=2)
        v_all = torch.cat([self.v, v_new], dim=2)
        self.k, self.v = k_all[:, :, -self.window:], v_all[:, :, -self.window:]
        self.length += k_new.shape[2]
        return k_all, v_all

    def reorder(self, index: Tensor) -> None:
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
        self._capacity = (index.numel(),) + self._capacity[1:]

    def reset(self) -> None:
        self.k, self.v, self.length = self.k[:, :, :0], self.v[:, :, :0], 0


class LinearStateCache:
    """Linear attention's running sums, sum phi(k) v^T (B, Hkv, D, D) and sum phi(k)
    (B, Hkv, D): constant memory, however long the output."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.kv_sum = torch.zeros((batch_size, num_kv_heads, head_dim, head_dim), dtype=dtype,
                                  device=device)
        self.k_sum = torch.zeros((batch_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.kv_sum.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nelement() * t.element_size() for t in (self.kv_sum, self.k_sum))

    @property
    def state(self) -> tuple[Tensor, Tensor]:
        return self.kv_sum, self.k_sum

    def advance(self, state: tuple[Tensor, Tensor], steps: int) -> None:
        """Store the sums after `steps` more tokens."""
        self.kv_sum, self.k_sum = state
        self.length += steps

    def reorder(self, index: Tensor) -> None:
        self.kv_sum, self.k_sum = self.kv_sum.index_select(0, index), self.k_sum.index_select(0, index)

    def reset(self) -> None:
        self.kv_sum, self.k_sum, self.length = torch.zeros_like(self.kv_sum), \
            torch.zeros_like(self.k_sum), 0
