"""The batchers' per-item index, kept narrow: for a corpus of millions of pairs its bytes
per item are what training's memory grows by (docs/scaling.md, the token store).

- lengths in the narrowest signed type holding them (int16 below 32,768 tokens);
- positions (orders, rows) in int32 below 2^31 items;
- an epoch's batches as views of one order array (EpochBatches), never a Python
  object per item;
- the length sort done in place on one int64 key per item (length_batches), where
  np.lexsort would hold int64 keys, their argsorts and an int64 result at once.

numpy only: the token store (data/store.py) uses it without importing torch.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

CHUNK = 1 << 18        # items per step of the chunked passes: bounds their temporaries


def copy_as(values: np.ndarray, dtype) -> np.ndarray:
    """values (n,) copied as dtype a chunk at a time: astype's casting temporaries are
    not bounded, these are."""
    out = np.empty(len(values), dtype=dtype)
    for start in range(0, len(values), CHUNK):
        out[start:start + CHUNK] = values[start:start + CHUNK]
    return out


def index_dtype(count: int) -> np.dtype:
    """The type of positions among `count` items: int32 when it holds them."""
    return np.dtype(np.int32) if count < 1 << 31 else np.dtype(np.int64)


def narrow_lengths(lengths: np.ndarray) -> np.ndarray:
    """(n,) integer lengths -> the same values as int16 when they fit, else int32 (else
    int64): two such arrays a pair are the batcher's lasting cost."""
    top = int(lengths.max()) if len(lengths) else 0
    for dtype in (np.int16, np.int32):
        if top <= np.iinfo(dtype).max:
            return lengths.astype(dtype, copy=False)
    return lengths.astype(np.int64, copy=False)


class EpochBatches(Sequence):
    """An epoch's batches: batch k is order[bounds[k]:bounds[k + 1]], taken in the
    sequence `sequence` (the shuffled batch numbers). Indexing gives a view of `order`,
    a slice gives EpochBatches, so a whole epoch costs one order array and two small
    per-batch arrays, nothing per item in Python objects."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray, sequence: np.ndarray):
        self.order = order            # (items,) positions, index_dtype
        self.bounds = bounds          # (batches + 1,) int64, ascending, from 0 to items
        self.sequence = sequence      # (taken,) batch numbers, in the order they are taken

    def __len__(self) -> int:
        return len(self.sequence)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return EpochBatches(self.order, self.bounds, self.sequence[index])
        batch = int(self.sequence[index])
        return self.order[self.bounds[batch]:self.bounds[batch + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for batch in self.sequence:
            yield self.order[self.bounds[batch]:self.bounds[batch + 1]]

    def sizes(self) -> np.ndarray:
        """(batches,) items per batch, in batch-number order (not `sequence`'s)."""
        return np.diff(self.bounds)


def _tie_ranks(count: int, rng: np.random.Generator | None) -> np.ndarray:
    """(count,) index_dtype: item r[j] has tie-break rank j. The ranks are
    rng.permutation(count) (a shuffle of an arange draws the same, in 4 bytes an item
    instead of 8), inverted; None: the items in order."""
    dtype = index_dtype(count)
    if rng is None:
        return np.arange(count, dtype=dtype)
    ties = np.arange(count, dtype=dtype)
    rng.shuffle(ties)                                   # ties[i]: item i's rank
    ranked = np.empty_like(ties)
    for start in range(0, count, CHUNK):                # ranked[ties[i]] = i
        stop = min(start + CHUNK, count)
        ranked[ties[start:stop]] = np.arange(start, stop, dtype=dtype)
    return ranked


def _key_bits(count: int, groups: int) -> int | None:
    """Bits for the rank in a (group << bits | rank) int64 key; None when it does not fit."""
    bits = max(1, (count - 1).bit_length())
    return bits if groups.bit_length() + bits <= 63 else None


def _sorted_by_key(ranked: np.ndarray, group_of, groups: int, bits: int) -> np.ndarray:
    """ranked (n,), group_of(items) -> their groups (int64) -> (n,) int64 keys
    group << bits | rank, sorted in place: the order by (group, rank)."""
    keys = np.empty(len(ranked), dtype=np.int64)
    for start in range(0, len(ranked), CHUNK):
        stop = min(start + CHUNK, len(ranked))
        keys[start:stop] = group_of(ranked[start:stop]) << bits
        keys[start:stop] |= np.arange(start, stop, dtype=np.int64)
    keys.sort()                                         # unique keys: any sort agrees
    return keys


def _length_order(lengths: np.ndarray, then: np.ndarray | None,
                  rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """Items sorted by lengths, then `then`, then a random rank -> (order (n,)
    index_dtype, lengths[order] (n,)); the same order as np.lexsort((rng.permutation(n),
    then, lengths)), peaking at 12 bytes an item (int32 ranks and int64 keys)."""
    count = len(lengths)
    width = 1 if then is None else int(then.max()) + 1
    groups = (int(lengths.max()) + 1) * width

    def group_of(items: np.ndarray) -> np.ndarray:
        group = lengths[items].astype(np.int64) * width
        return group if then is None else group + then[items]

    ranked = _tie_ranks(count, rng)
    bits = _key_bits(count, groups)
    if bits is None:                                    # lengths too large to pack
        ties = np.empty_like(ranked)
        ties[ranked] = np.arange(count, dtype=ranked.dtype)
        keys = (ties,) if then is None else (ties, then)
        order = np.lexsort(keys + (lengths,)).astype(ranked.dtype)
        return order, gather(lengths, order)
    keys = _sorted_by_key(ranked, group_of, groups, bits)
    for start in range(0, count, CHUNK):                # rank -> item, in place
        keys[start:start + CHUNK] = ranked[keys[start:start + CHUNK] & ((1 << bits) - 1)]
    dtype = ranked.dtype
    del ranked
    order = copy_as(keys, dtype)
    del keys
    return order, gather(lengths, order)


def gather(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """values[positions] (n,), in chunks: numpy turns a whole int32 index into an
    int64 copy first, 8 bytes an item."""
    out = np.empty(len(positions), dtype=values.dtype)
    for start in range(0, len(positions), CHUNK):
        out[start:start + CHUNK] = values[positions[start:start + CHUNK]]
    return out


def greedy_bounds(ordered_lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    """ordered_lengths (n,), non-decreasing, each <= max_tokens -> (batches + 1,) int64:
    each batch takes the most items from its start with size x its longest (its last)
    <= max_tokens, as a greedy cut item by item would, one numpy step a batch."""
    bounds, start, count = [0], 0, len(ordered_lengths)
    while start < count:
        window = ordered_lengths[start:start + max_tokens // int(ordered_lengths[start])]
        cost = np.arange(1, len(window) + 1, dtype=np.int64) * window   # grows with size
        start += int(np.count_nonzero(cost <= max_tokens))
        bounds.append(start)
    return np.asarray(bounds, dtype=np.int64)


def length_batches(lengths: np.ndarray, max_tokens: int, rng: np.random.Generator | None,
                   *, then: np.ndarray | None = None) -> EpochBatches:
    """Items grouped by length (then by `then`, then ties in a random order from rng;
    None: in order, and the batches in order), cut greedily so that B x the longest
    item <= max_tokens, the batches then shuffled with rng. lengths, then: (n,) >= 1.
    rng draws permutation(n), then permutation(batches), as every earlier version."""
    order, ordered_lengths = _length_order(lengths, then, rng)
    bounds = greedy_bounds(ordered_lengths, max_tokens)
    del ordered_lengths
    batches = len(bounds) - 1
    sequence = rng.permutation(batches) if rng is not None else np.arange(batches)
    return EpochBatches(order, bounds, sequence)
