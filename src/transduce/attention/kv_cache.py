"""What a self-attention layer keeps between decoding steps: one interface, four caches.

    AttentionCache    the interface: attend(q, k, v, ...) appends this step's keys and
                      values and attends over everything held; reorder(index) keeps
                      batch rows (beam survivors, running sentences) by copying only the
                      rows that move (keep_rows); rewind(length) forgets the tokens
                      after the first `length` (a rejected draft), where it can, as far
                      back as allow_rewind() asked it to be able to; nbytes, length,
                      reset().
    KVCache           keys and values of every past token (softmax attention), in buffers
                      allocated once for the longest output; update() writes in place and
                      returns views. Size per layer, by the seeds' formula (kv_cache_bytes):
                      2 x kv_heads x head_dim x bytes x tokens x batch.
    QuantizedKVCache  the same in int8, one float scale per token and head: about 4x
                      smaller than float32 (plus the scales); a decoding step reads the
                      integers directly (quantized.py), no float copy is made.
    Int4KVCache       4-bit values, two per byte, a float scale per group of 32.
    ConcatKVCache     keys and values grown by concatenation instead of written into
                      preallocated buffers: the form an exported graph takes (past in,
                      present = past + this step out), where nothing is updated in place.
    SlidingKVCache    (local.py) only the last `window` keys and values (and as many
                      more as it may be asked to forget).
    LinearStateCache  (linear.py) linear attention's running sums, whatever the length.

Shapes: queries (B, H, T, D); keys and values (B, Hkv, T, D), this step's T tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
from torch import Tensor

from transduce.attention import masks
from transduce.attention.kernels import attention
from transduce.attention.quantized import quantized_decode_attention

# attend() returns the output (B, H, T, D), and the weights (B, H, T, S) when asked.
Attended = Tensor | tuple[Tensor, Tensor]


def refuse_position_bias(position_bias: Tensor | None, kind: str) -> None:
    """Relative-position score biases exist for softmax attention over all keys only."""
    if position_bias is not None:
        raise ValueError(f"{kind} takes no position_bias (relative positions are a bias on "
                         "the full softmax attention's scores)")


def refuse_softcap(softcap: float | None, kind: str) -> None:
    """Score soft-capping exists for softmax attention (over all keys or a window)."""
    if softcap is not None:
        raise ValueError(f"{kind} takes no softcap (it caps softmax attention's scores)")


class AttentionCache(ABC):
    """The decoding state of one self-attention layer. `_buffers` names its (B, ...)
    tensors, which reorder() rearranges and nbytes counts."""

    _buffers: tuple[str, ...] = ()
    length: int = 0         # tokens seen so far: the position of the next token

    @abstractmethod
    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
               causal: bool, impl: str, return_weights: bool = False,
               position_bias: Tensor | None = None,
               softcap: float | None = None) -> Attended:
        """Take this step's keys and values into the cache and attend q over all held.
        mask covers every key the cache has seen and this step's (B|1, 1, 1|T,
        length + T): left padding stays masked for the whole generation. softcap: see
        kernels.attention."""

    @property
    def batch_size(self) -> int:
        return getattr(self, self._buffers[0]).shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held, measured from the tensors themselves."""
        return sum(tensor_bytes(getattr(self, name)) for name in self._buffers)

    def reorder(self, index: Tensor | RowPlan) -> None:
        """Keep batch rows `index` (B',) in that order (or their plan, plan_rows)."""
        for name in self._buffers:
            setattr(self, name, keep_rows(getattr(self, name), index, self._filled))

    @property
    def _filled(self) -> int | None:
        """Positions of dim 2 that hold data (None: all of them), what reorder copies."""
        return None

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache for a new batch of the same size."""

    def allow_rewind(self, tokens: int) -> None:
        """From now on, keep what forgetting the latest `tokens` tokens needs (a
        speculative search's rejected drafts). Running sums cannot be taken apart."""
        raise self._cannot_forget()

    def rewind(self, length: int) -> None:
        """Forget every token after the first `length`, where allow_rewind() allows."""
        raise self._cannot_forget()

    def _cannot_forget(self) -> ValueError:
        return ValueError(f"{type(self).__name__} cannot forget tokens it has taken: only "
                          "the caches of softmax and sliding-window attention can rewind")


class KVCache(AttentionCache):
    """Keys and values (B, Hkv, max_len, D), filled up to `length`."""

    _buffers = ("k", "v")

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def _filled(self) -> int:
        return self.length

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

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
               causal: bool, impl: str, return_weights: bool = False,
               position_bias: Tensor | None = None,
               softcap: float | None = None) -> Attended:
        """q (B, H, T, D) over every cached key, this step's included. Attention runs in
        the cache's type (a float32 cache for a bfloat16 model, say): casting the step's
        queries is cheap, casting the whole cache would not be."""
        k, v = self.update(k, v)                                         # (B, Hkv, S, D)
        result = attention(q.to(k.dtype), k, v, mask, causal=causal, impl=impl,
                           return_weights=return_weights, position_bias=position_bias,
                           softcap=softcap)
        if return_weights:
            return result[0].to(q.dtype), result[1].to(q.dtype)
        return result.to(q.dtype)

    def reset(self) -> None:
        self.length = 0

    def allow_rewind(self, tokens: int) -> None:
        """Every token is held: any rewind is allowed."""

    def rewind(self, length: int) -> None:
        """Keep the first `length` tokens (0 <= length <= self.length); the next update
        writes over the rest. The quantized caches' scales go with their positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} tokens to {length}")
        self.length = length


class ConcatKVCache(AttentionCache):
    """Keys and values (B, Hkv, T, D) of every past token; each step makes new tensors,
    past ++ this step's. length is read from the tensors' shape, so a traced graph keeps
    it symbolic (an empty past gives position 0). step_mask, when given, is the next
    step's causal mask (1, 1, T, P + T), built by the caller from sizes it knows to be
    symbolic (an export: its inputs'); attend then uses it instead of building one."""

    _buffers = ("k", "v")

    def __init__(self, k: Tensor, v: Tensor, step_mask: Tensor | None = None):
        if not torch.jit.is_tracing() and (k.shape != v.shape or k.dim() != 4):
            raise ValueError(f"past keys {tuple(k.shape)} and values {tuple(v.shape)} must "
                             "have one (B, Hkv, T, D) shape")
        self.k, self.v, self.step_mask = k, v, step_mask

    @property
    def length(self) -> int:   # a traced size while exporting
        return self.k.shape[2]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
               causal: bool, impl: str, return_weights: bool = False,
               position_bias: Tensor | None = None,
               softcap: float | None = None) -> Attended:
        self.k = torch.cat([self.k, k.to(self.k.dtype)], dim=2)
        self.v = torch.cat([self.v, v.to(self.v.dtype)], dim=2)
        if causal and self.step_mask is not None:
            mask, causal = masks.combine(mask, self.step_mask), False
        self.step_mask = None
        return attention(q, self.k, self.v, mask, causal=causal, impl=impl,
                         return_weights=return_weights, position_bias=position_bias,
                         softcap=softcap)

    def reset(self) -> None:
        self.k, self.v = self.k[:, :, :0], self.v[:, :, :0]


class QuantizedCache(KVCache):
    """What the int8 and int4 caches share: integer keys and values with float32 scales
    beside them. A decoding step (one query per row) attends by reading the integers
    directly (quantized.py: the scales are applied to scores and weights, no float copy
    of the cache is made); the prompt's prefill and requests for the weights dequantize
    what is held and use the ordinary kernels."""

    _buffers = ("k", "v", "k_scale", "v_scale")

    def _allocate_scales(self, groups: int, device: torch.device | str | None) -> None:
        batch, kv_heads, max_len = self.k.shape[:3]
        self.k_scale = torch.zeros(batch, kv_heads, max_len, groups, device=device)
        self.v_scale = torch.zeros(batch, kv_heads, max_len, groups, device=device)

    @abstractmethod
    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, Hkv, T, D) -> the stored integers and their scales."""

    @abstractmethod
    def dequantize(self, stored: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        """Stored integers and their scales (B, Hkv, S, ...) -> (B, Hkv, S, D) in dtype."""

    def store(self, k_new: Tensor, v_new: Tensor) -> None:
        """Append (B, Hkv, T, D) keys and values, quantized."""
        start = self.length
        k_stored, k_scale = self.quantize(k_new)
        v_stored, v_scale = self.quantize(v_new)
        KVCache.update(self, k_stored, v_stored)
        self.k_scale[:, :, start:self.length] = k_scale
        self.v_scale[:, :, start:self.length] = v_scale

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append, and return every held key and value dequantized to k_new's dtype."""
        self.store(k_new, v_new)
        end = self.length
        return (self.dequantize(self.k[:, :, :end], self.k_scale[:, :, :end], k_new.dtype),
                self.dequantize(self.v[:, :, :end], self.v_scale[:, :, :end], k_new.dtype))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
               causal: bool, impl: str, return_weights: bool = False,
               position_bias: Tensor | None = None,
               softcap: float | None = None) -> Attended:
        if q.shape[2] != 1 or return_weights or softcap is not None:
            k, v = self.update(k, v)
            return attention(q, k, v, mask, causal=causal, impl=impl,
                             return_weights=return_weights, position_bias=position_bias,
                             softcap=softcap)
        self.store(k, v)
        return quantized_decode_attention(q, self.k, self.k_scale, self.v, self.v_scale, mask,
                                          length=self.length, position_bias=position_bias)


class QuantizedKVCache(QuantizedCache):
    """Keys and values stored as int8 with a symmetric scale per (token, head):
    x ~ scale * round(x / scale), scale = max|x| / 127 over the head's D values."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 device: torch.device | str | None = None):
        super().__init__(batch_size, num_kv_heads, max_len, head_dim, dtype=torch.int8,
                         device=device)
        self._allocate_scales(1, device)

    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return quantize_int8(x)

    def dequantize(self, stored: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        return dequantize_int8(stored, scale, dtype)


class Int4KVCache(QuantizedCache):
    """Keys and values stored as 4-bit integers, two per byte, with a symmetric float32
    scale per group of INT4_GROUP values of a (token, head) vector:
    x ~ scale * round(x / scale), scale = max|x| / 7 over the group. A quarter of
    float16's bytes plus the scales."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 device: torch.device | str | None = None):
        if head_dim % 2:
            raise ValueError(f"an int4 cache packs two values per byte: head_dim={head_dim} "
                             "must be even")
        super().__init__(batch_size, num_kv_heads, max_len, head_dim // 2, dtype=torch.uint8,
                         device=device)
        self.group = int4_group(head_dim)
        self._allocate_scales(head_dim // self.group, device)

    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return quantize_int4(x, self.group)

    def dequantize(self, stored: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        return dequantize_int4(stored, scale, dtype)


INT4_GROUP = 32


def int4_group(head_dim: int) -> int:
    """Values per scale: INT4_GROUP, or the whole head when it does not divide it."""
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


def quantize_int4(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """(..., D) -> packed uint8 (..., D / 2) (value + 8 in each nibble, even index low)
    and float32 scales (..., D / group)."""
    grouped = x.detach().float().unflatten(-1, (-1, group))                # (..., G, group)
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 7.0
    values = (grouped / scale).round().clamp(-7, 7).to(torch.uint8).add_(8).flatten(-2)
    return values[..., 0::2] | (values[..., 1::2] << 4), scale.squeeze(-1)


def dequantize_int4(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """packed (..., D / 2) uint8, scale (..., G) -> (..., D) in dtype."""
    low = (packed & 0x0F).to(dtype) - 8
    high = (packed >> 4).to(dtype) - 8
    values = torch.stack([low, high], dim=-1).flatten(-2)                 # (..., D)
    grouped = values.unflatten(-1, (scale.shape[-1], -1))
    return (grouped * scale.to(dtype).unsqueeze(-1)).flatten(-2)


def kv_cache_bytes(*, tokens: int, batch: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """The seeds' formula for one layer: 2 (K and V) x kv_heads x head_dim x bytes per
    element x tokens x batch; int8 adds one float32 scale per token and head, int4 (half
    a byte per element) one per group of int4_group(head_dim) values."""
    if dtype == torch.int4:
        per_vector = head_dim // 2 + 4 * (head_dim // int4_group(head_dim))
        return 2 * kv_heads * per_vector * tokens * batch
    scales = 4 if dtype == torch.int8 else 0
    return 2 * kv_heads * (head_dim * element_size(dtype) + scales) * tokens * batch


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_bytes(tensor: Tensor) -> int:
    return tensor.nelement() * tensor.element_size()


class RowPlan(NamedTuple):
    """How keep_rows brings rows `index` of tensors of `held` rows to the front: the
    places whose row changes (in place, when few do) or one gather. Planned once per
    reorder for every cache of a model, which all hold the same rows."""

    index: Tensor            # (B',) the rows kept, in order
    held: int                # rows of the tensors it was planned for
    moved: Tensor | None     # (M,) places taking another row's data; None: gather all
    sources: Tensor | None   # (M,) index[moved], the rows they take
    count: int               # M


def plan_rows(index: Tensor, held: int) -> RowPlan:
    """A row i with index[i] == i stays where it is and only the other rows are copied:
    beam search keeps most beams in their rows and moves the last sentences into the
    places of finished ones, so a step copies a few rows instead of the whole cache.
    When many rows move, one gather into a fresh buffer is cheaper."""
    rows = index.numel()
    if rows <= held:
        moved = (index != torch.arange(rows, device=index.device)).nonzero().squeeze(1)
        count = moved.numel()
        # Copying a moved row in place costs about 2.5x its share of a whole gather
        # (index_copy_ after index_select, measured on CPU): worth it below 40% moved.
        if 5 * count <= 2 * rows:
            return RowPlan(index, held, moved, index[moved] if count else moved, count)
    return RowPlan(index, held, None, None, rows)


def keep_rows(x: Tensor, index: Tensor | RowPlan, length: int | None = None) -> Tensor:
    """x.index_select(0, index) for x (B, ...), computed by rearranging x's rows in place
    where that is cheaper (plan_rows), over positions [:length] of dim 2 (all when
    None). x's first B' rows are then the result. index: the rows, or their plan."""
    plan = index if isinstance(index, RowPlan) and index.held == x.shape[0] else \
        plan_rows(index.index if isinstance(index, RowPlan) else index, x.shape[0])
    if x.requires_grad:   # decoding outside inference mode: out= cannot record a graph
        return x.index_select(0, plan.index)
    rows = plan.index.numel()
    filled = (lambda t: t) if length is None else (lambda t: t[:, :, :length])
    if plan.moved is not None:
        if plan.count:
            target = filled(x)
            target.index_copy_(0, plan.moved, target.index_select(0, plan.sources))
        return x if rows == x.shape[0] else x[:rows]
    new = x.new_empty((rows,) + x.shape[1:])
    torch.index_select(filled(x), 0, plan.index, out=filled(new))
    return new


def dequantize_int8(values: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """int8 values (..., D), scales (..., 1) -> (..., D) in dtype."""
    return values.to(dtype) * scale.to(dtype)


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(..., D) -> int8 values (..., D) and float32 scales (..., 1), per vector."""
    scale = x.detach().float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale
