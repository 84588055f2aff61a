"""The only place attention masks are built.

Masks are boolean and True means "may attend" (the SDPA convention). Every mask here
broadcasts to scores of shape (B, H, T, S): batch, heads, queries, keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def padding_mask(lengths: Tensor, max_len: int | None = None) -> Tensor:
    """Keys at positions < length may be attended.

    lengths: (B,) integer -> mask (B, 1, 1, S) with S = max_len or max(lengths).
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    size = int(lengths.max()) if max_len is None else max_len
    positions = torch.arange(size, device=lengths.device)
    return (positions[None, :] < lengths[:, None])[:, None, None, :]


def padding_mask_from_ids(ids: Tensor, pad_id: int) -> Tensor:
    """Every non-pad token may be attended. ids (B, S) -> mask (B, 1, 1, S)."""
    return (ids != pad_id)[:, None, None, :]


def causal_mask(num_queries: int, num_keys: int | None = None, offset: int | None = None,
                device: torch.device | str | None = None) -> Tensor:
    """Query i may attend key j when j <= i + offset.

    The default offset, num_keys - num_queries, aligns the queries with the last keys:
    the full causal pass when T == S, and a cached decode step where T new queries
    follow S - T cached keys. -> mask (1, 1, T, S)
    """
    keys = num_queries if num_keys is None else num_keys
    shift = keys - num_queries if offset is None else offset
    query_pos = torch.arange(num_queries, device=device)[:, None]
    key_pos = torch.arange(keys, device=device)[None, :]
    return (key_pos <= query_pos + shift)[None, None]


def four_d(mask: Tensor) -> Tensor:
    """A mask of up to 4 dimensions as (B|1, H|1, T|1, S), leading ones added."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def combine(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the masks given (None entries ignored); None if none given."""
    result: Tensor | None = None
    for mask in masks:
        if mask is None:
            continue
        result = mask if result is None else result & mask
    return result


def group_heads(mask: Tensor, kv_heads: int, group: int) -> Tensor:
    """Reshape a mask for grouped queries: (B|1, H|1, T|1, S) -> (B|1, Hkv|1, G|1, T|1, S).

    Kernels that stack the G query heads sharing one key/value head use this layout.
    """
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.unflatten(1, (kv_heads, group))


def band_mask(num_queries: int, num_keys: int, window: int, *, causal: bool,
              query_offset: int = 0, device: torch.device | str | None = None) -> Tensor:
    """Local (sliding-window) attention: query i, at position query_offset + i, may attend
    key j when |i' - j| <= window, and only j <= i' when causal. -> mask (1, 1, T, S)"""
    query_pos = torch.arange(num_queries, device=device)[:, None] + query_offset
    distance = query_pos - torch.arange(num_keys, device=device)[None, :]
    allowed = distance <= window if causal else distance.abs() <= window
    if causal:
        allowed &= distance >= 0
    return allowed[None, None]


def key_padding(mask: Tensor | None, what: str) -> Tensor | None:
    """The (B, S) key mask inside a (B, 1, 1, S) padding mask, for kernels that take only
    key padding (no per-query pattern)."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise ValueError(f"{what} takes a key padding mask of shape (B, 1, 1, S), got "
                         f"{tuple(mask.shape)}")
    return mask[:, 0, 0, :]


# Padding's sentence numbers inside a Segments mask: past every sentence's, so the numbers
# never decrease along a row, and different for queries and keys, so padding attends
# nothing and nothing attends padding.
PAD_SEGMENT = 1 << 30
PAD_KEY_SEGMENT = PAD_SEGMENT + 1


@dataclass(frozen=True)
class Segments:
    """A packed batch's mask, kept as each token's sentence number in its row: a query may
    attend the keys of its own sentence only (with causal=True, up to itself).

    Several sentences share a row so that a batch holds no padding but a row's end, and
    every batch has the same shape. Why not the dense (B, 1, T, S) mask it stands for:
    a FlashAttention kernel that reads the numbers skips every tile of keys from other
    sentences (impl="triton"); the other kernels take `dense()`. Numbers start at 0 in
    each row and never decrease along it; padding is PAD_SEGMENT among the queries and
    PAD_KEY_SEGMENT among the keys (`Segments.packed` builds them so).
    """
    queries: Tensor   # (B, T) int32
    keys: Tensor      # (B, S) int32

    @staticmethod
    def packed(queries: Tensor, keys: Tensor) -> "Segments":
        """Queries numbered (B, T) over keys numbered (B, S) as a packed batch numbers them
        (data/packing.py: 0, 1, ... along a row, padding -1)."""
        return Segments(queries.masked_fill(queries < 0, PAD_SEGMENT),
                        keys.masked_fill(keys < 0, PAD_KEY_SEGMENT))

    def dense(self) -> Tensor:
        """-> (B, 1, T, S) bool, True where query and key belong to the same sentence."""
        return (self.queries[:, :, None] == self.keys[:, None, :])[:, None]


def positions_in_segments(numbers: Tensor) -> Tensor:
    """(B, T) sentence numbers of a packed batch -> (B, T) int64, each token's position in
    its own sentence (what position tables and rotary read; padding counts from where
    the padding starts)."""
    index = torch.arange(numbers.shape[1], device=numbers.device).expand_as(numbers)
    first = torch.ones_like(numbers, dtype=torch.bool)
    first[:, 1:] = numbers[:, 1:] != numbers[:, :-1]
    starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - starts
