"""Sliding-window (local) attention: each query attends only the keys within `window`
positions of it (on either side, or before it when causal), as in Longformer's and
Mistral's local attention.

The sequence is cut into blocks of b >= window queries; a block's keys are its own block
and its neighbours (previous and next; previous only when causal), so time and memory
grow as T * 3b instead of T^2. The blocks go through the ordinary kernels with a band
mask, so softmax, grouping and fully masked rows behave exactly as in kernels.py.

Shapes: q (B, H, T, D); k, v (B, H_kv, T, D), the same positions as q (self-attention);
key_mask (B, T), True = a real key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from transduce.attention import masks
from transduce.attention.kernels import attention
from transduce.attention.kv_cache import (Attended, AttentionCache, Int4KVCache, KVCache,
                                          QuantizedKVCache, element_size, kv_cache_bytes,
                                          refuse_position_bias)

MIN_BLOCK = 8


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None,
                             window: int, *, causal: bool, impl: str = "sdpa",
                             dropout_p: float = 0.0) -> Tensor:
    """-> out (B, H, T, D), equal to attention() with masks.band_mask over the full length."""
    blocks = Blocks.of(q, k, window, causal)
    out = attention(blocks.queries(q), blocks.keys(k), blocks.keys(v),
                    blocks.band_allowed(key_mask), impl=impl, dropout_p=dropout_p)
    return blocks.unblock(out)


@dataclass(frozen=True)
class Blocks:
    """A self-attention of length T cut into n query blocks of b >= window queries, each
    with its band of keys: its own block and its neighbours (previous only when causal),
    span = 3b (2b) keys, block j's starting at (j - 1) b."""
    batch: int
    length: int
    block: int
    window: int
    causal: bool
    device: torch.device

    @staticmethod
    def of(q: Tensor, k: Tensor, window: int, causal: bool) -> Blocks:
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"local and sparse attention are self-attention: {q.shape[2]} "
                             f"queries but {k.shape[2]} keys")
        return Blocks(q.shape[0], q.shape[2], max(window, MIN_BLOCK), window, causal, q.device)

    @property
    def count(self) -> int:
        """Blocks: ceil(T / b), in non-negative terms (a trace's division truncates)."""
        return (self.length + self.block - 1) // self.block

    @property
    def span(self) -> int:
        return (2 if self.causal else 3) * self.block

    def _pads(self) -> tuple[int, int]:
        """Keys padded before and after the sequence so that every block has its span."""
        padded = self.count * self.block
        return self.block, padded - self.length + (0 if self.causal else self.block)

    def queries(self, q: Tensor) -> Tensor:
        """(B, H, T, D) -> (B * n, H, b, D)."""
        padded = F.pad(q, (0, 0, 0, self.count * self.block - self.length))
        return padded.unflatten(2, (self.count, self.block)).transpose(1, 2).flatten(0, 1)

    def _bands(self, blocks: Tensor, into: int) -> Tensor:
        """blocks (B, n + k - 1, ...), the padded sequence's: each block's band of k =
        span / b of them, its neighbours and itself, joined along `into` -> (B, n, ...).
        Slices joined, not unfold's windows, so that a trace (the ONNX export) keeps the
        number of blocks a size of its input."""
        width = self.span // self.block
        return torch.cat([blocks[:, i:i - width + 1 or None] for i in range(width)], dim=into)

    def keys(self, x: Tensor) -> Tensor:
        """(B, Hkv, T, D) -> (B * n, Hkv, span, D): each block's band of keys."""
        blocks = F.pad(x, (0, 0, *self._pads())).unflatten(2, (-1, self.block))
        return self._bands(blocks.transpose(1, 2), 3).flatten(0, 1)   # (B, n, Hkv, span, D)

    def band_allowed(self, key_mask: Tensor | None) -> Tensor:
        """(B * n, 1, b, span): the window around each query, over real keys. Query i of
        any block sits at b + i relative to its key block's first key."""
        valid = key_mask if key_mask is not None else \
            torch.ones(self.batch, self.length, dtype=torch.bool, device=self.device)
        valid = F.pad(valid, self._pads(), value=False).unflatten(1, (-1, self.block))
        valid = self._bands(valid, 2)                                       # (B, n, span)
        band = masks.band_mask(self.block, self.span, self.window, causal=self.causal,
                               query_offset=self.block, device=self.device)  # (1, 1, b, span)
        return band & valid.flatten(0, 1)[:, None, None, :]

    def unblock(self, out: Tensor) -> Tensor:
        """(B * n, H, b, D) -> (B, H, T, D)."""
        out = out.unflatten(0, (self.batch, self.count)).transpose(1, 2).flatten(2, 3)
        return out[:, :, :self.length]


class SlidingKVCache(AttentionCache):
    """The last `window` keys and values: all a sliding-window decoder step can attend
    to besides its own key. Memory stays (B, Hkv, window, D) however long the output;
    (B, Hkv, window + r, D) once allow_rewind(r), so that forgetting r tokens leaves the
    window the next step reads (the band mask keeps the older keys out of attention).
    Every buffer (`_buffers`) holds the same positions along dim 2."""

    _buffers = ("k", "v")

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 max_len: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        shape = (batch_size, num_kv_heads, 0, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.window, self.max_len = window, max_len
        self.rewindable = 0      # latest tokens that can be forgotten
        self.length = 0

    @property
    def capacity(self) -> int:
        """Keys held once full: the window and the rewindable tokens, or max_len."""
        held = self.window + self.rewindable
        return held if self.max_len is None else min(held, self.max_len)

    @property
    def nbytes(self) -> int:
        """The bytes of a full cache (what it holds once `capacity` tokens are in)."""
        batch, heads, _, dim = self.k.shape
        return 2 * batch * heads * self.capacity * dim * element_size(self.k.dtype)

    @property
    def held(self) -> int:
        """Keys held now (at most window + rewindable)."""
        return self.k.shape[2]

    def encode(self, k_new: Tensor, v_new: Tensor) -> dict[str, Tensor]:
        """This step's keys and values as the buffers hold them, by buffer name."""
        return {"k": k_new, "v": v_new}

    def decode(self, held: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Buffers -> keys and values (B, Hkv, S, D) in dtype."""
        return held["k"], held["v"]

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append (B, Hkv, T, D) -> the held keys and values followed by the new ones
        (B, Hkv, held + T, D); the first of them sits at position length - held."""
        new = self.encode(k_new, v_new)
        every = {name: torch.cat([getattr(self, name), new[name]], dim=2)
                 for name in self._buffers}
        kept = self.window + self.rewindable
        for name, tensor in every.items():
            setattr(self, name, tensor[:, :, -kept:])
        self.length += k_new.shape[2]
        return self.decode(every, k_new.dtype)

    def allow_rewind(self, tokens: int) -> None:
        """Hold `tokens` keys beyond the window from the next update on."""
        if tokens < 0:
            raise ValueError(f"allow_rewind({tokens}): a number of tokens, at least 0")
        self.rewindable = tokens

    def rewind(self, length: int) -> None:
        """Forget the tokens after the first `length`, as long as the window before
        position `length` is still held (at most `rewindable` tokens back)."""
        forgotten = self.length - length
        if forgotten < 0 or self.held - forgotten < min(self.window, length):
            raise ValueError(f"cannot rewind a sliding-window cache of {self.length} tokens "
                             f"to {length}: it holds the window of {self.window} and "
                             f"{self.rewindable} tokens more that it may forget "
                             f"(allow_rewind)")
        self._keep(self.held - forgotten)
        self.length = length

    def _keep(self, positions: int) -> None:
        for name in self._buffers:
            setattr(self, name, getattr(self, name)[:, :, :positions])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
               causal: bool, impl: str, return_weights: bool = False,
               position_bias: Tensor | None = None,
               softcap: float | None = None) -> Attended:
        """q (B, H, T, D) over the held window and this step's keys, banded. mask covers
        every key seen (B|1, 1, 1|T, length + T); the window's part of it is used."""
        refuse_position_bias(position_bias, "sliding-window attention")
        older = self.held
        k, v = self.update(k, v)
        mask = None if mask is None else mask[..., -k.shape[2]:]
        band = masks.band_mask(q.shape[2], k.shape[2], self.window, causal=causal,
                               query_offset=older, device=q.device)
        return attention(q, k, v, masks.combine(mask, band), impl=impl,
                         return_weights=return_weights, softcap=softcap)

    def reset(self) -> None:
        self._keep(0)
        self.length = 0


class BandedKVCache(KVCache):
    """A plain cache whose steps attend to the last `window` keys before each query (and
    its own) among all it holds, by a band mask: a sliding layer's cache in a continuous
    batch (decode/continuous_generation.py) of a model whose other layers attend to the
    whole context, where every layer's cache is a view of the same slots."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 window: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__(batch_size, num_kv_heads, max_len, head_dim, dtype=dtype,
                         device=device)
        self.window = window

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
               causal: bool, impl: str, return_weights: bool = False,
               position_bias: Tensor | None = None,
               softcap: float | None = None) -> Attended:
        """KVCache.attend under the band of the queries' positions (they end the keys)."""
        refuse_position_bias(position_bias, "sliding-window attention")
        keys = self.length + k.shape[2]
        band = masks.band_mask(q.shape[2], keys, self.window, causal=True,
                               query_offset=keys - q.shape[2], device=q.device)
        return super().attend(q, k, v, masks.combine(mask, band), causal=causal, impl=impl,
                              return_weights=return_weights, softcap=softcap)


class QuantizedSlidingKVCache(SlidingKVCache):
    """The window's keys and values in int8 (a float32 scale per token and head) or
    int4 (two per byte, a scale per group), stored and restored by QuantizedKVCache's and
    Int4KVCache's own codes (an empty one of them is the codec); a step dequantizes the
    window it attends over."""

    _buffers = ("k", "v", "k_scale", "v_scale")

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 dtype: torch.dtype, max_len: int | None = None,
                 device: torch.device | str | None = None):
        codecs = {torch.int8: QuantizedKVCache, torch.int4: Int4KVCache}
        if dtype not in codecs:
            raise ValueError(f"QuantizedSlidingKVCache stores int8 or int4, not {dtype}")
        self.codec = codecs[dtype](batch_size, num_kv_heads, 0, head_dim, device=device)
        self.stored, self.head_dim = dtype, head_dim
        super().__init__(batch_size, num_kv_heads, window, head_dim, max_len=max_len,
                         device="meta")
        for name in self._buffers:                     # empty, in the codec's types
            setattr(self, name, getattr(self.codec, name))

    @property
    def nbytes(self) -> int:
        """The formula's bytes of a full cache (kv_cache_bytes over `capacity` tokens)."""
        batch, heads = self.k.shape[:2]
        return kv_cache_bytes(tokens=self.capacity, batch=batch, kv_heads=heads,
                              head_dim=self.head_dim, dtype=self.stored)

    def encode(self, k_new: Tensor, v_new: Tensor) -> dict[str, Tensor]:
        (k, k_scale), (v, v_scale) = self.codec.quantize(k_new), self.codec.quantize(v_new)
        return {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}

    def decode(self, held: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return (self.codec.dequantize(held["k"], held["k_scale"], dtype),
                self.codec.dequantize(held["v"], held["v_scale"], dtype))
