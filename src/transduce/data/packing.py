"""Sentence pairs packed into rows of a fixed length: batches of one shape, next to no
padding (`transduce train --pack-length L` for a translation model).

A batch is max_tokens // L rows of L source and L target tokens. Pairs are taken in a
seeded shuffle of the corpus and placed first-fit: each into the first row with room for
both its sides; the batch closes when a pair fits in no row, and that pair opens the
next. Pair i of a row is source i and target i of that row, in the same layouts as
TokenBatcher's (src = ids + [eos], tgt_in = [bos] + ids, tgt_out = ids + [eos]); the
sentence numbers of every token (attention/masks.py: Segments) keep each pair's
attention to itself, so the model computes each pair as it would alone.

Why: every batch then has the same shape, which compiled training (CUDA graphs,
torch.compile without dynamic shapes) needs, and padding is left only at row ends,
where length-sorted batches pad every sentence to the longest of its batch.
Each epoch's batches are a pure function of (seed, epoch), so a run resumes mid-epoch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from transduce.data.batching import Batch, BatchingError, Ids, _EpochBatches, _lengths, longer_than
from transduce.data.order import EpochBatches, index_dtype
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


class PackedPairBatcher(_EpochBatches):
    """Batches of max_tokens // length rows, each row packed with whole pairs."""

    def __init__(self, src_ids: Ids, tgt_ids: Ids, length: int, max_tokens: int, *,
                 seed: int = 0, shuffle: bool = True,
                 line_numbers: Sequence[int] | None = None):
        if len(src_ids) != len(tgt_ids) or not len(src_ids):
            raise BatchingError(f"need the same, non-zero number of source and target "
                                f"sentences, got {len(src_ids)} and {len(tgt_ids)}")
        if not 0 < length <= max_tokens:
            raise BatchingError(f"pack length {length} must be in [1, max_tokens={max_tokens}]: "
                                f"a batch holds max_tokens // pack length rows")
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.src_lengths, self.tgt_lengths = _lengths(src_ids), _lengths(tgt_ids)
        self.length, self.rows = length, max_tokens // length
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        too_long = longer_than(np.maximum(self.src_lengths, self.tgt_lengths), length, "pair",
                               line_numbers)
        if too_long:
            count, worst = too_long
            raise BatchingError(f"{count} do not fit a packed row of {length} tokens; {worst}. "
                                f"Raise the pack length or lower max_len")

    def epoch_batches(self, epoch: int) -> EpochBatches:
        """The batches of an epoch (arrays of pair indices, in placing order),
        deterministic in (seed, epoch)."""
        count = len(self.src_lengths)
        order = np.arange(count, dtype=index_dtype(count))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        bounds = [0]
        rooms = self._empty_batch()
        for position, pair in enumerate(order):
            if rooms.place(pair) is None:      # the pair opens the next batch
                bounds.append(position)
                rooms = self._empty_batch()
                rooms.place(pair)
        bounds.append(count)
        return EpochBatches(order, np.asarray(bounds, dtype=np.int64),
                            np.arange(len(bounds) - 1))   # already in shuffled order

    def placement(self, indices: np.ndarray) -> list[list[int]]:
        """The pairs of each row, in order: first-fit of `indices` in their order."""
        rooms, rows = self._empty_batch(), [[] for _ in range(self.rows)]
        for pair in indices:
            row = rooms.place(pair)
            if row is None:
                raise BatchingError(f"pairs {list(indices)} do not fit one packed batch of "
                                    f"{self.rows} rows of {self.length} tokens")
            rows[row].append(int(pair))
        return rows

    def _empty_batch(self) -> "_Rooms":
        return _Rooms(self.rows, self.length, self.src_lengths, self.tgt_lengths)

    def collate(self, indices: np.ndarray) -> Batch:
        """-> a Batch of (rows, length) src, tgt_in, tgt_out, their sentence numbers, and
        per pair (in row order) src_lengths, tgt_lengths and indices."""
        rows = self.placement(indices)
        shape = (self.rows, self.length)
        src, tgt_in, tgt_out = (np.full(shape, PAD_ID, dtype=np.int64) for _ in range(3))
        for row, pairs in enumerate(rows):
            s_at = t_at = 0
            for pair in pairs:
                s, t = self.src_ids[pair], self.tgt_ids[pair]
                src[row, s_at:s_at + len(s)], src[row, s_at + len(s)] = s, EOS_ID
                tgt_in[row, t_at], tgt_in[row, t_at + 1:t_at + len(t) + 1] = BOS_ID, t
                tgt_out[row, t_at:t_at + len(t)], tgt_out[row, t_at + len(t)] = t, EOS_ID
                s_at, t_at = s_at + len(s) + 1, t_at + len(t) + 1
        ordered = np.asarray([pair for pairs in rows for pair in pairs], dtype=np.int64)
        return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                     torch.from_numpy(self.src_lengths[ordered].astype(np.int64)),
                     torch.from_numpy(self.tgt_lengths[ordered].astype(np.int64)),
                     torch.from_numpy(ordered),
                     src_numbers=self._numbers(rows, self.src_lengths),
                     tgt_numbers=self._numbers(rows, self.tgt_lengths))

    def _numbers(self, rows: list[list[int]], lengths: np.ndarray) -> torch.Tensor:
        """-> (rows, length) int32: each token's pair number in its row."""
        return sentence_numbers([[int(lengths[pair]) for pair in pairs] for pairs in rows],
                                self.length)

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of padding among all batch positions, source and target together."""
        batches = len(self.epoch_batches(epoch))
        real = int(self.src_lengths.sum(dtype=np.int64) + self.tgt_lengths.sum(dtype=np.int64))
        return 1.0 - real / (2 * batches * self.rows * self.length)


def sentence_numbers(lengths: list[list[int]], row_length: int) -> torch.Tensor:
    """Each row's sentence lengths, in order -> (rows, row_length) int32: each token's
    sentence number in its row (0, 1, ...), padding -1. The model reads them as a packed
    batch's attention mask and positions."""
    numbers = np.full((len(lengths), row_length), -1, dtype=np.int32)
    for row, row_lengths in enumerate(lengths):
        if sum(row_lengths) > row_length:
            raise BatchingError(f"row {row}'s sentences ({sum(row_lengths)} tokens) do not fit "
                                f"a row of {row_length}")
        numbers[row, :sum(row_lengths)] = np.repeat(np.arange(len(row_lengths), dtype=np.int32),
                                                    row_lengths)
    return torch.from_numpy(numbers)


class _Rooms:
    """The free tokens left on each side of each row of a batch being packed."""

    def __init__(self, rows: int, length: int, src_lengths: np.ndarray, tgt_lengths: np.ndarray):
        self.src = np.full(rows, length, dtype=np.int64)
        self.tgt = np.full(rows, length, dtype=np.int64)
        self.src_lengths, self.tgt_lengths = src_lengths, tgt_lengths

    def place(self, pair: int) -> int | None:
        """The first row with room for both sides of `pair` (its rooms shrink), or None."""
        src_length, tgt_length = int(self.src_lengths[pair]), int(self.tgt_lengths[pair])
        fits = (self.src >= src_length) & (self.tgt >= tgt_length)
        row = int(fits.argmax())
        if not fits[row]:
            return None
        self.src[row] -= src_length
        self.tgt[row] -= tgt_length
        return row
