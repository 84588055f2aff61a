"""Batches by token count, as in the paper: sentences grouped by length, each batch about
N source and N target tokens counting padding.

Each epoch's batches are a pure function of (seed, epoch): pairs are ordered by their
longer side, then source length, ties broken by a seeded shuffle, cut greedily into batches
under the budget, and the batch order is shuffled with the same seed. A run can resume
mid-epoch from (epoch, batch position).

Layout of one pair: src = ids + [eos]; tgt_in = [bos] + ids; tgt_out = ids + [eos].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transduce.errors import TransduceError


class BatchingError(TransduceError, ValueError):
    """A batching setting that cannot work with this data; the message names the pair."""


@dataclass
class Batch:
    src: Tensor            # (B, S) source ids + eos, right-padded
    tgt_in: Tensor         # (B, T) bos + target ids, right-padded
    tgt_out: Tensor        # (B, T) target ids + eos, right-padded
    src_lengths: Tensor    # (B,) without padding
    tgt_lengths: Tensor    # (B,)
    indices: Tensor        # (B,) positions of the pairs in the dataset

    @property
    def num_tgt_tokens(self) -> int:
        return int(self.tgt_lengths.sum())

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.src, self.tgt_in, self.tgt_out, self.src_lengths,
                        self.tgt_lengths, self.indices)))


@dataclass
class LengthFilter:
    """Which pairs fit max_len tokens (specials included) on both sides, and a report."""

    kept: np.ndarray       # indices of the pairs kept
    dropped: np.ndarray    # indices of the pairs over the limit

    @classmethod
    def apply(cls, src_ids: Sequence[np.ndarray], tgt_ids: Sequence[np.ndarray],
              max_len: int) -> "LengthFilter":
        lengths = np.maximum(_lengths(src_ids), _lengths(tgt_ids))
        return cls(np.flatnonzero(lengths <= max_len), np.flatnonzero(lengths > max_len))

    def report(self, src_ids: Sequence[np.ndarray], tgt_ids: Sequence[np.ndarray],
               line_numbers: Sequence[int], max_len: int) -> str:
        if not len(self.dropped):
            return f"all {len(self.kept)} pairs fit {max_len} tokens"
        lengths = np.maximum(_lengths(src_ids), _lengths(tgt_ids))
        longest = int(self.dropped[np.argmax(lengths[self.dropped])])
        return (f"filtered {len(self.dropped)} of {len(lengths)} pairs longer than {max_len} "
                f"tokens; the longest is line {line_numbers[longest]} with "
                f"{len(src_ids[longest]) + 1} source and {len(tgt_ids[longest]) + 1} target tokens")


def _lengths(ids: Sequence[np.ndarray]) -> np.ndarray:
    """Tokens per pair side with its one special (eos, or bos for tgt_in)."""
    return np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))


class TokenBatcher:
    """Token-budget batches over a tokenised parallel dataset.

    max_tokens bounds B * max(src len) and B * max(tgt len) of every batch: padded
    tokens count, so no batch ever exceeds the budget on either side.
    """

    def __init__(self, src_ids: Sequence[np.ndarray], tgt_ids: Sequence[np.ndarray],
                 max_tokens: int, *, seed: int = 0, shuffle: bool = True,
                 line_numbers: Sequence[int] | None = None):
        if len(src_ids) != len(tgt_ids) or not len(src_ids):
            raise BatchingError(f"need the same, non-zero number of source and target sentences, "
                                f"got {len(src_ids)} and {len(tgt_ids)}")
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.src_lengths, self.tgt_lengths = _lengths(src_ids), _lengths(tgt_ids)
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        longest = np.maximum(self.src_lengths, self.tgt_lengths)
        too_long = np.flatnonzero(longest > max_tokens)
        if len(too_long):
            worst = int(too_long[np.argmax(longest[too_long])])
            where = f"line {line_numbers[worst]}" if line_numbers is not None else f"pair {worst}"
            raise BatchingError(f"{len(too_long)} of {len(longest)} pairs cannot fit a batch of "
                                f"{max_tokens} tokens even alone; the longest ({where}) has {int(longest[worst])} "
                                f"tokens. Raise the batch size or lower the length limit")

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches of an epoch (arrays of pair indices), deterministic in (seed, epoch)."""
        rng = np.random.default_rng([self.seed, epoch])
        ties = rng.permutation(len(self.src_lengths)) if self.shuffle else \
            np.arange(len(self.src_lengths))
        # A batch is charged B x its longest side, so group by that first, then by source
        # length (on the Bible split: 3.9% padding at 4096 tokens, 6.4% at 25k, against
        # 6.4% and 20.8% when sorting by source then target length).
        longest = np.maximum(self.src_lengths, self.tgt_lengths)
        order = np.lexsort((ties, self.src_lengths, longest))
        batches, start = [], 0
        longest_src = longest_tgt = 0
        for position, index in enumerate(order):
            src_max = max(longest_src, self.src_lengths[index])
            tgt_max = max(longest_tgt, self.tgt_lengths[index])
            size = position - start + 1
            if size * max(src_max, tgt_max) > self.max_tokens:
                batches.append(order[start:position])
                start, src_max, tgt_max = position, self.src_lengths[index], self.tgt_lengths[index]
            longest_src, longest_tgt = src_max, tgt_max
        batches.append(order[start:])
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate(epoch=0)

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Batches of an epoch from position `start` (to resume a run mid-epoch)."""
        for indices in self.epoch_batches(epoch)[start:]:
            yield self.collate(indices)

    def collate(self, indices: np.ndarray) -> Batch:
        size = len(indices)
        src_len, tgt_len = self.src_lengths[indices], self.tgt_lengths[indices]
        src = np.full((size, src_len.max()), PAD_ID, dtype=np.int64)
        tgt_in = np.full((size, tgt_len.max()), PAD_ID, dtype=np.int64)
        tgt_out = np.full((size, tgt_len.max()), PAD_ID, dtype=np.int64)
        for row, index in enumerate(indices):
            s, t = self.src_ids[index], self.tgt_ids[index]
            src[row, :len(s)], src[row, len(s)] = s, EOS_ID
            tgt_in[row, 0], tgt_in[row, 1:len(t) + 1] = BOS_ID, t
            tgt_out[row, :len(t)], tgt_out[row, len(t)] = t, EOS_ID
        return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                     torch.from_numpy(src_len), torch.from_numpy(tgt_len),
                     torch.from_numpy(np.asarray(indices, dtype=np.int64)))

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of padding among all batch positions, source and target together."""
        padded = real = 0
        for indices in self.epoch_batches(epoch):
            size = len(indices)
            padded += size * (self.src_lengths[indices].max() + self.tgt_lengths[indices].max())
            real += self.src_lengths[indices].sum() + self.tgt_lengths[indices].sum()
        return 1.0 - real / padded
