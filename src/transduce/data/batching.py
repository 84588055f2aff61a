"""Batches by token count, as in the paper: sentences grouped by length, each batch about
N source and N target tokens counting padding.

Each epoch's batches are a pure function of (seed, epoch): pairs are ordered by their
longer side, then source length, ties broken by a seeded shuffle, cut greedily into batches
under the budget, and the batch order is shuffled with the same seed. A run can resume
mid-epoch from (epoch, batch position).

Layout of one pair: src = ids + [eos]; tgt_in = [bos] + ids; tgt_out = ids + [eos].
A multilingual model's pairs are given their languages (TokenBatcher's source_prefix
and forced: the codes, decode/languages.py): src = [code] + ids + [eos]; tgt_in =
[bos, code] + ids; tgt_out = [pad] + ids + [eos], the given code not scored.

An encoder (BERT) reads items of its own layouts: EncoderBatcher (data/masking.py).

A language model's lines have no source side: TokenBatcher(None, ids, ...) batches them
by the same rule, with src an empty (B, 0) tensor. PackedBatcher instead cuts the token
stream of all lines into fixed blocks across line boundaries (GPT). A line is read with
its vocabulary's specials (LineSpecials: ours, or an imported GPT-2's or Llama's, which
pad with eos and so mark the targets not scored with IGNORE). Both give the loop
the same four things: epoch_batches(epoch) (a sequence of index arrays, pure in (seed,
epoch), so a run resumes mid-epoch), collate(indices), target_tokens(indices),
padding_fraction().

Every batcher works from lengths alone (a token store's StoredIds gives them from its
offsets) and reads ids only in collate; what it keeps per item is narrow (data/order.py:
int16 lengths, int32 orders, an epoch as views of one order array), since at millions
of pairs those bytes are what training's memory grows by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.masking import (IGNORE, SENTENCEPIECE, EncoderBatch, EncoderSpecials,
                                    crop_pair, encoder_item, generator, mask_tokens,
                                    masked_count, next_sentence_pairs)
from transduce.data.order import (EpochBatches, gather, index_dtype, length_batches,
                                  narrow_lengths)
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, TextTokenizer
from transduce.errors import TransduceError


class BatchingError(TransduceError, ValueError):
    """A batching setting that cannot work with this data; the message names the pair."""


@dataclass
class Batch:
    src: Tensor            # (B, S) source ids + eos, right-padded
    tgt_in: Tensor         # (B, T) bos + target ids, right-padded
    tgt_out: Tensor        # (B, T) target ids + eos, right-padded
    src_lengths: Tensor    # (B,) without padding
    tgt_lengths: Tensor    # (B,) targets scored: tgt_out's tokens but padding (or IGNORE)
    indices: Tensor        # (B,) positions of the pairs (lines, blocks) in the dataset
    # Packed rows (data/packing.py) hold several pairs: each token's sentence number in its
    # row (B, S) and (B, T) (attention/masks.py: Segments), and the three per-pair fields
    # above are then (pairs,), in row order.
    src_numbers: Tensor | None = None
    tgt_numbers: Tensor | None = None

    @property
    def num_tgt_tokens(self) -> int:
        return int(self.tgt_lengths.sum())

    @property
    def segments(self) -> tuple[Tensor, Tensor] | None:
        """What the model's forward takes for packed rows (None: one pair a row)."""
        return None if self.src_numbers is None else (self.src_numbers, self.tgt_numbers)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(None if t is None else t.to(device, non_blocking=True) for t in
                       (self.src, self.tgt_in, self.tgt_out, self.src_lengths,
                        self.tgt_lengths, self.indices, self.src_numbers, self.tgt_numbers)))


Ids = Sequence[np.ndarray]


@dataclass(frozen=True)
class LineSpecials:
    """The ids a batch is built with: a line is [bos] + ids on input and ids + [eos] as
    targets, input rows are padded with `pad`, and targets not scored hold `unscored`.
    Ours (SentencePiece) pad both with pad 0. An imported language model's tokenizer.json
    has its own ids and may pad with eos (GPT-2, Llama), which is also a target to
    predict, so its unscored targets are IGNORE."""

    bos: int
    eos: int
    pad: int
    unscored: int

    @classmethod
    def of(cls, tokenizer: TextTokenizer) -> "LineSpecials":
        if not isinstance(tokenizer, HFTokenizer):
            return SENTENCEPIECE_LINES
        return cls(tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, IGNORE)

    @property
    def shares_bos(self) -> bool:
        """Whether one token both ends a line and opens the next (GPT-2's <|endoftext|>)."""
        return self.bos == self.eos

    @property
    def loss_pad(self) -> int | None:
        """The pad id the loss leaves out of label smoothing: None where pad is also a
        token the model predicts (eos) or reads (bos)."""
        return None if self.pad in (self.bos, self.eos) else self.pad


SENTENCEPIECE_LINES = LineSpecials(BOS_ID, EOS_ID, PAD_ID, PAD_ID)


@dataclass
class LengthFilter:
    """Which pairs fit max_len tokens (specials included) on both sides, and a report.
    src_ids None: lines of a text corpus, one side."""

    kept: np.ndarray       # indices of the pairs kept
    dropped: np.ndarray    # indices of the pairs over the limit

    @classmethod
    def apply(cls, src_ids: Ids | None, tgt_ids: Ids, max_len: int) -> "LengthFilter":
        """The filter; one that would keep nothing of a non-empty split is an error."""
        lengths = _longest_side(src_ids, tgt_ids)
        kept = cls(np.flatnonzero(lengths <= max_len), np.flatnonzero(lengths > max_len))
        if len(lengths) and not len(kept.kept):
            unit, side = ("pairs", " on its longer side") if src_ids is not None else ("lines", "")
            raise BatchingError(f"max_len={max_len}: none of the {len(lengths)} {unit} fits; the "
                                f"shortest needs {int(lengths.min())} tokens{side} (bos or eos "
                                f"included)")
        return kept

    def report(self, src_ids: Ids | None, tgt_ids: Ids, line_numbers: Sequence[int],
               max_len: int) -> str:
        unit = "pairs" if src_ids is not None else "lines"
        if not len(self.dropped):
            return f"all {len(self.kept)} {unit} fit {max_len} tokens"
        lengths = _longest_side(src_ids, tgt_ids)
        longest = int(self.dropped[np.argmax(lengths[self.dropped])])
        tokens = f"{len(tgt_ids[longest]) + 1} tokens" if src_ids is None else \
            f"{len(src_ids[longest]) + 1} source and {len(tgt_ids[longest]) + 1} target tokens"
        return (f"filtered {len(self.dropped)} of {len(lengths)} {unit} longer than {max_len} "
                f"tokens; the longest is line {line_numbers[longest]} with {tokens}")


def _lengths(ids: Ids) -> np.ndarray:
    """Tokens per pair side with its one special (eos, or bos for tgt_in) -> (n,) int16
    (int32 past 32,767 tokens): the batcher keeps two such arrays, its lasting cost per
    pair. Ids that know their lengths (data/store.py's StoredIds) are not read."""
    known = getattr(ids, "lengths", None)
    if known is not None:
        return narrow_lengths(np.add(known, 1, dtype=np.int64 if known.dtype == np.int64
                                     else np.int32))
    return narrow_lengths(np.fromiter((len(x) + 1 for x in ids), dtype=np.int64,
                                      count=len(ids)))


def longer_than(longest: np.ndarray, limit: int, unit: str,
                line_numbers: Sequence[int] | None) -> tuple[str, str] | None:
    """Items whose longest side (n,) exceeds limit, in words: ("3 of 500 pairs", "the
    longest (line 12) has 70 tokens"); None when there are none."""
    too_long = np.flatnonzero(longest > limit)
    if not len(too_long):
        return None
    worst = int(too_long[np.argmax(longest[too_long])])
    where = f"line {line_numbers[worst]}" if line_numbers is not None else f"{unit} {worst}"
    return (f"{len(too_long)} of {len(longest)} {unit}s",
            f"the longest ({where}) has {int(longest[worst])} tokens")


def _longest_side(src_ids: Ids | None, tgt_ids: Ids) -> np.ndarray:
    return _lengths(tgt_ids) if src_ids is None else \
        np.maximum(_lengths(src_ids), _lengths(tgt_ids))


class Batcher(Protocol):
    """What the training loop and its resume machinery (train/state.py) need."""

    def epoch_batches(self, epoch: int) -> Sequence[np.ndarray]: ...
    def collate(self, indices: np.ndarray) -> Batch: ...
    def target_tokens(self, indices: np.ndarray) -> int: ...
    def padding_fraction(self, epoch: int = 0) -> float: ...


class _EpochBatches:
    """What both batchers share, over their epoch_batches, collate and the scored
    target tokens of each item (tgt_lengths)."""

    tgt_lengths: np.ndarray

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate(epoch=0)

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Batches of an epoch from position `start` (to resume a run mid-epoch)."""
        for indices in self.epoch_batches(epoch)[start:]:
            yield self.collate(indices)

    def target_tokens(self, indices: np.ndarray) -> int:
        """Target tokens scored (eos included) of the pairs, lines or blocks `indices`."""
        return int(self.tgt_lengths[indices].sum())


class TokenBatcher(_EpochBatches):
    """Token-budget batches over a tokenised parallel dataset, or over the lines of a
    text corpus (src_ids None: no source side, src is (B, 0)).

    max_tokens bounds B * max(src len) and B * max(tgt len) of every batch: padded
    tokens count, so no batch ever exceeds the budget on either side. source_prefix and
    forced: ids every source starts with and every target is given after bos, unscored
    (a multilingual model's languages). specials: the vocabulary's (ours by default).
    """

    def __init__(self, src_ids: Ids | None, tgt_ids: Ids, max_tokens: int, *, seed: int = 0,
                 shuffle: bool = True, line_numbers: Sequence[int] | None = None,
                 source_prefix: Sequence[int] = (), forced: Sequence[int] = (),
                 specials: LineSpecials = SENTENCEPIECE_LINES):
        if src_ids is None and not len(tgt_ids):
            raise BatchingError("need at least one line, got none")
        if src_ids is not None and (len(src_ids) != len(tgt_ids) or not len(src_ids)):
            raise BatchingError(f"need the same, non-zero number of source and target sentences, "
                                f"got {len(src_ids)} and {len(tgt_ids)}")
        if src_ids is None and (source_prefix or forced):
            raise BatchingError("lines of a language model take no languages")
        self.src_ids, self.tgt_ids, self.specials = src_ids, tgt_ids, specials
        self.source_prefix = np.asarray(source_prefix, dtype=np.int64)
        self.forced = np.asarray(forced, dtype=np.int64)
        self.tgt_lengths = _lengths(tgt_ids)          # scored: the given tokens are not
        # No source side: length 0, which changes neither the order nor the budget.
        self.src_lengths = np.zeros_like(self.tgt_lengths) if src_ids is None else \
            _lengths(src_ids) + len(source_prefix)
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        unit = "pair" if src_ids is not None else "line"
        too_long = longer_than(self._longest(), max_tokens, unit, line_numbers)
        if too_long:
            count, worst = too_long
            raise BatchingError(f"{count} cannot fit a batch of {max_tokens} tokens even alone; "
                                f"{worst}. Raise the batch size or lower the length limit")

    def epoch_batches(self, epoch: int) -> EpochBatches:
        """The batches of an epoch (arrays of pair indices), deterministic in (seed, epoch)."""
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        # A batch is charged B x its longest side, so group by that first, then by source
        # length (on the Bible split: 3.9% padding at 4096 tokens, 6.4% at 25k, against
        # 6.4% and 20.8% when sorting by source then target length).
        return length_batches(self._longest(), self.max_tokens, rng, then=self.src_lengths)

    def _longest(self) -> np.ndarray:
        """(pairs,) the longer side of each pair as a batch holds it."""
        return np.maximum(self.src_lengths, self.tgt_lengths + len(self.forced))

    def collate(self, indices: np.ndarray) -> Batch:
        size, prefix, forced, sp = len(indices), self.source_prefix, self.forced, self.specials
        src_len, tgt_len = self.src_lengths[indices], self.tgt_lengths[indices]
        given = len(forced)
        src = np.full((size, src_len.max()), sp.pad, dtype=np.int64)        # (B, 0) for lines
        tgt_in = np.full((size, tgt_len.max() + given), sp.pad, dtype=np.int64)
        tgt_out = np.full((size, tgt_len.max() + given), sp.unscored, dtype=np.int64)
        src[:, :len(prefix)], tgt_in[:, 0], tgt_in[:, 1:given + 1] = prefix, sp.bos, forced
        for row, index in enumerate(indices):
            t = self.tgt_ids[index]
            if self.src_ids is not None:
                s, start = self.src_ids[index], len(prefix)
                src[row, start:start + len(s)], src[row, start + len(s)] = s, sp.eos
            tgt_in[row, given + 1:given + len(t) + 1] = t
            tgt_out[row, given:given + len(t)], tgt_out[row, given + len(t)] = t, sp.eos
        return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                     torch.from_numpy(src_len.astype(np.int64)),
                     torch.from_numpy(tgt_len.astype(np.int64)),
                     torch.from_numpy(np.asarray(indices, dtype=np.int64)))

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of padding among all batch positions, source and target together."""
        batches = self.epoch_batches(epoch)
        starts, sizes = batches.bounds[:-1], batches.sizes()
        padded = 0
        target = self.tgt_lengths + len(self.forced) if len(self.forced) else self.tgt_lengths
        for lengths in (self.src_lengths, target):
            ordered = gather(lengths, batches.order)                          # (pairs,)
            padded += int((sizes * np.maximum.reduceat(ordered, starts)).sum())
        real = int(self.src_lengths.sum(dtype=np.int64) + target.sum(dtype=np.int64))
        return 1.0 - real / padded


def pack_stream(ids: Ids, specials: LineSpecials = SENTENCEPIECE_LINES) -> np.ndarray:
    """Every line as [bos] + ids + [eos], one after the other -> (N,) int64: the line
    layout's tgt_in and tgt_out of each line, run together. Where bos is eos (GPT-2's
    <|endoftext|>), one token closes a line and opens the next, as GPT-2 was trained:
    bos ids_0 bos ids_1 ... bos ids_n eos."""
    closing = [] if specials.shares_bos else [specials.eos]
    pieces = [np.concatenate(([specials.bos], line, closing)) for line in ids]
    if specials.shares_bos:
        pieces.append(np.array([specials.eos]))
    return np.concatenate(pieces).astype(np.int64)


def _line_starts(ids: Ids, shares_bos: bool) -> np.ndarray:
    """(lines + 1,) int64: where each line's bos is in pack_stream's stream, and its end
    (without the closing eos where one token ends a line and opens the next), from the
    lengths alone (a token store's are not read)."""
    starts = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(_lengths(ids), dtype=np.int64, out=starts[1:])              # ids + eos
    if not shares_bos:
        starts[1:] += np.arange(1, len(ids) + 1)                           # + bos
    return starts


class PackedBatcher(_EpochBatches):
    """Fixed blocks of `length` tokens cut from the stream of every line, across line
    boundaries (GPT): block j reads input stream[jL : jL + L] and predicts target
    stream[jL + 1 : jL + L + 1], so every token but the first is predicted once, with
    the lines before it (within the block) as context. The last block is shorter,
    padded. Blocks are shuffled per epoch by (seed, epoch); max_tokens // length blocks
    make a batch.

    The stream is pack_stream's: each line opened by bos and closed by eos, and a
    target that is a line's bos (the position after an eos) is not scored, so every
    line is predicted as the line layout predicts it, from bos to its eos, and a model
    trained either way is scored and continued the same way. Where one token is both
    (GPT-2's), it closes a line and opens the next, and every target is scored: the
    same predictions. One difference remains: in a block a line starts at any position,
    after the lines before it, so a line alone at position 0 (as dev evaluation and
    `transduce evaluate` score it) is a case packed training sees only at the stream's
    start; a tiny model trained for a few hundred steps continues lines well after
    context, less reliably without it.

    The stream is never built: a block's span is read line by line from `ids` when it
    is collated (from its files, for a token store's StoredIds), and what is kept is one
    int64 start per line and two per block. specials: the vocabulary's (ours by default).
    """

    def __init__(self, ids: Ids, length: int, max_tokens: int, *, seed: int = 0,
                 shuffle: bool = True, specials: LineSpecials = SENTENCEPIECE_LINES):
        if not len(ids):
            raise BatchingError("need at least one line to pack, got none")
        if not 0 < length <= max_tokens:
            raise BatchingError(f"pack length {length} must be in [1, max_tokens={max_tokens}]: "
                                f"a batch holds max_tokens // pack length blocks")
        self.length, self.max_tokens, self.seed, self.shuffle = length, max_tokens, seed, shuffle
        self.ids, self.specials = ids, specials
        self.line_starts = _line_starts(ids, specials.shares_bos)          # (lines + 1,)
        total = int(self.line_starts[-1]) + specials.shares_bos            # N
        self.num_blocks = -(-(total - 1) // length)                        # ceil((N - 1) / L)
        self.blocks_per_batch = max_tokens // length
        starts = np.arange(self.num_blocks, dtype=np.int64) * length
        self.block_lengths = np.minimum(length, total - 1 - starts)        # (blocks,)
        # Targets scored per block: its positions, less the bos targets (line starts)
        # among stream[start + 1 : start + count + 1].
        first, last = self._opening_targets(starts, self.block_lengths)
        self.tgt_lengths = self.block_lengths - (last - first)             # (blocks,)

    def _opening_targets(self, starts: np.ndarray, counts: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
        """Blocks' starts and target counts (k,) -> (first, last) (k,): line_starts[first:
        last] are the lines whose bos is one of the block's targets, not scored; none
        where one token closes a line and opens the next."""
        if self.specials.shares_bos:
            return np.zeros_like(starts), np.zeros_like(starts)
        return (np.searchsorted(self.line_starts, starts + 1, side="left"),
                np.searchsorted(self.line_starts, starts + counts, side="right"))

    def stream(self, begin: int, end: int) -> np.ndarray:
        """stream[begin:end] -> (end - begin,) int64, read from the lines it covers."""
        out = np.empty(end - begin, dtype=np.int64)
        line = min(int(np.searchsorted(self.line_starts, begin, side="right")) - 1,
                   len(self.ids) - 1)      # the closing eos of a shared stream: the last's
        position, sp = begin, self.specials
        while position < end:
            ids = self.ids[line]
            first = int(self.line_starts[line])
            piece = np.empty(len(ids) + 2, dtype=np.int64)                 # bos ids eos
            piece[0], piece[1:-1], piece[-1] = sp.bos, ids, sp.eos
            # A shared eos is the next line's bos: the next line then starts past it.
            stop = min(first + len(piece), end)
            out[position - begin:stop - begin] = piece[position - first:stop - first]
            position, line = stop, line + 1
        return out

    def epoch_batches(self, epoch: int) -> EpochBatches:
        """The batches of an epoch (arrays of block indices), deterministic in (seed, epoch)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks) \
            if self.shuffle else np.arange(self.num_blocks)
        bounds = np.append(np.arange(0, self.num_blocks, self.blocks_per_batch),
                           self.num_blocks)
        return EpochBatches(order, bounds, np.arange(len(bounds) - 1))

    def collate(self, indices: np.ndarray) -> Batch:
        size, width = len(indices), int(self.block_lengths[indices].max())
        tgt_in = np.full((size, width), self.specials.pad, dtype=np.int64)       # (B, L)
        tgt_out = np.full((size, width), self.specials.unscored, dtype=np.int64)  # (B, L)
        starts = indices.astype(np.int64) * self.length
        counts = self.block_lengths[indices]
        first, last = self._opening_targets(starts, counts)
        for row, (start, count) in enumerate(zip(starts.tolist(), counts.tolist())):
            span = self.stream(start, start + count + 1)                      # (count + 1,)
            tgt_in[row, :count], tgt_out[row, :count] = span[:-1], span[1:]
            # the start of the next line is not predicted
            tgt_out[row, self.line_starts[first[row]:last[row]] - start - 1] = \
                self.specials.unscored
        return Batch(torch.zeros((size, 0), dtype=torch.long), torch.from_numpy(tgt_in),
                     torch.from_numpy(tgt_out), torch.zeros(size, dtype=torch.long),
                     torch.from_numpy(self.tgt_lengths[indices]),
                     torch.from_numpy(np.asarray(indices, dtype=np.int64)))

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of padding among all input positions (only the last block has some)."""
        padded = sum(len(b) * int(self.block_lengths[b].max()) for b in self.epoch_batches(epoch))
        return 1.0 - float(self.block_lengths.sum()) / padded


class EncoderBatcher(_EpochBatches):
    """Batches for an encoder (BERT, data/masking.py has the layouts and masking):

    - masked LM (mask=True, pairs=False): item i is [CLS] line i [SEP];
    - masked LM + next sentence (mask=True, pairs=True): item i is [CLS] line i [SEP]
      B [SEP], B the next line or, in half the items, a random one, drawn anew each
      epoch from (seed, epoch);
    - classification (labels given, mask=False): item i is [CLS] text i [SEP], label i,
      or with second_ids [CLS] text i [SEP] second i [SEP] (entailment, paraphrase);
    - token classification (tags given, mask=False): item i is [CLS] sentence i [SEP],
      its labels (T,) tags[i] at the pieces, IGNORE at the markers (data/tagged.py);
    - question answering (spans given, with second_ids, mask=False): item i is [CLS]
      question i [SEP] window i [SEP], its answer's start and end positions spans[i]
      (data/answer_windows.py; the windows fit max_len, so nothing is cropped).

    Items are cropped to max_len tokens and batched by length under max_tokens as
    TokenBatcher batches lines. collate(indices, key) masks with a generator seeded by
    (seed, *key), the loop's key being (epoch, batch position), so a resumed run sees the
    same masks. target_tokens counts what a batch scores: masked positions (MLM),
    sentences (classification), tagged words or windows (answers); scored_counts gives
    each part of the loss its count.
    specials: the vocabulary's [CLS], [SEP], pad and mask ids (ours by default).
    one_segment: a model of one segment type (RoBERTa) reads a pair as <s> A </s></s>
    B </s> (masking.encoder_item).
    """

    def __init__(self, ids: Ids, max_tokens: int, max_len: int, vocab_size: int, *,
                 mask: bool = True, pairs: bool = False, labels: Sequence[int] | None = None,
                 second_ids: Ids | None = None, seed: int = 0, shuffle: bool = True,
                 specials: EncoderSpecials = SENTENCEPIECE, one_segment: bool = False,
                 tags: Sequence[np.ndarray] | None = None, spans: np.ndarray | None = None):
        if max_len > max_tokens:
            raise BatchingError(f"a sequence of max_len={max_len} tokens cannot fit a batch "
                                f"of {max_tokens}; lower max_len or raise max_tokens")
        if labels is not None and tags is not None:
            raise BatchingError("an encoder batcher labels sentences or tokens, not both")
        if tags is not None and (len(tags) != len(ids) or second_ids is not None):
            raise BatchingError("tags go with the sentences of a batcher, one array each")
        if spans is not None and (labels is not None or second_ids is None
                                  or np.shape(spans) != (len(ids), 2)):
            raise BatchingError("answer spans (windows, 2) go with the questions and the "
                                "windows (second_ids) of a batcher, one each")
        supervised = labels is not None or tags is not None or spans is not None
        if supervised == mask or (supervised and pairs):
            raise BatchingError("an encoder batcher either masks (optionally pairs) or "
                                "classifies (labels, no masking)")
        if mask and specials.mask_id is None:
            raise BatchingError("the vocabulary has no mask token ([MASK] or <mask>): it "
                                "cannot train a masked LM")
        if len(ids) < (3 if pairs else 1):
            raise BatchingError(f"need at least {3 if pairs else 1} lines, got {len(ids)}")
        if second_ids is not None and ((labels is None and spans is None)
                                       or len(second_ids) != len(ids)):
            raise BatchingError("second texts pair with the texts of a classification "
                                "or question-answering batcher, one each")
        self.ids, self.max_tokens, self.max_len = ids, max_tokens, max_len
        self.vocab_size, self.mask, self.pairs = vocab_size, mask, pairs
        self.labels = None if labels is None else np.asarray(labels, dtype=np.int64)
        self.seed, self.shuffle, self.specials = seed, shuffle, specials
        self.second_ids, self.one_segment, self.tags = second_ids, one_segment, tags
        self.spans = None if spans is None else np.asarray(spans, dtype=np.int64)
        self.line_pieces = narrow_lengths(_lengths(ids) - 1)   # (lines,); a store's not read
        self._epoch, self._partners, self._nsp = None, None, None
        if second_ids is not None:   # given pairs: crop_pair keeps this many pieces
            markers = 3 + one_segment
            both = self.line_pieces.astype(np.int64) + _lengths(second_ids) - 1
            pieces = np.minimum(both, max_len - markers)
            self.lengths, self.tgt_lengths = narrow_lengths(pieces + markers), self._scored(pieces)
            if spans is not None and (both > pieces).any():
                raise BatchingError(f"question-answering windows must fit max_len="
                                    f"{max_len} whole (data/answer_windows.py builds them)")
        elif not pairs:   # fixed items: lengths and counts once
            pieces = np.minimum(self.line_pieces, max_len - 2)
            self.lengths, self.tgt_lengths = narrow_lengths(pieces + 2), self._scored(pieces)
            if tags is not None:     # the tagged words that cropping keeps
                self.tgt_lengths = np.asarray([int((t[:k] != IGNORE).sum())
                                               for t, k in zip(tags, pieces)], dtype=np.int32)

    def _scored(self, pieces: np.ndarray) -> np.ndarray:
        """(items,) int32 positions each item scores."""
        scored = masked_count(pieces) if self.mask else np.ones_like(pieces)
        return scored.astype(np.int32)

    def _pairs_of(self, epoch: int) -> None:
        """Pairs, their lengths and scored counts for this epoch (from (seed, epoch))."""
        if self._epoch == epoch:
            return
        rng = np.random.default_rng([self.seed, epoch, 1])
        partners, nsp = next_sentence_pairs(len(self.ids), rng)
        self._partners = partners.astype(index_dtype(len(self.ids)))       # (lines - 1,)
        self._nsp = nsp.astype(np.int8)                                    # (lines - 1,)
        del partners, nsp
        room = self.max_len - 3
        first = self.line_pieces[:-1].astype(np.int32)
        second = gather(self.line_pieces, self._partners)
        total = np.minimum(first + second, room)               # crop_pair keeps this many
        self.lengths, self.tgt_lengths = narrow_lengths(total + 3), self._scored(total)
        self._epoch = epoch

    @property
    def num_items(self) -> int:
        return len(self.ids) - 1 if self.pairs else len(self.ids)

    def epoch_batches(self, epoch: int) -> EpochBatches:
        """Batches of item indices, deterministic in (seed, epoch)."""
        if self.pairs:
            self._pairs_of(epoch)
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        return length_batches(self.lengths, self.max_tokens, rng)

    def target_tokens(self, indices: np.ndarray) -> int:
        """Scored positions (masked pieces) or sentences of the items `indices`."""
        return int(self.tgt_lengths[indices].sum())

    def scored_counts(self, indices: np.ndarray) -> dict[str, int]:
        """What each loss term of these items is normalised by."""
        if self.tags is not None:
            return {"tag": self.target_tokens(indices)}
        if self.spans is not None:
            return {"answer": len(indices)}
        if not self.mask:
            return {"classify": len(indices)}
        counts = {"mlm": self.target_tokens(indices)}
        if self.pairs:
            counts["nsp"] = len(indices)
        return counts

    def collate(self, indices: np.ndarray, key: tuple[int, ...] = (0, 0)) -> EncoderBatch:
        """The items as an EncoderBatch; key (epoch, batch) seeds the masking, and the
        epoch chooses the pairs."""
        if self.pairs:
            self._pairs_of(key[0])
        size, width = len(indices), int(self.lengths[indices].max())
        cls, sep = self.specials.cls_id, self.specials.sep_id
        ids = np.full((size, width), self.specials.pad_id, dtype=np.int64)    # (B, T)
        segments = np.zeros((size, width), dtype=np.int64)                    # (B, T)
        pieces = np.zeros((size, width), dtype=bool)   # (B, T) the texts' pieces, not markers
        for row, index in enumerate(indices):
            a, b = crop_pair(self.ids[index], self._second(index), self.max_len,
                             self.one_segment)
            item = encoder_item(a, b, cls, sep, self.one_segment)
            length = len(item[0])
            ids[row, :length], segments[row, :length], pieces[row, :length] = item
        tokens = torch.from_numpy(ids)
        mlm_labels = None
        if self.mask:
            tokens, mlm_labels = mask_tokens(tokens, self.vocab_size,
                                             generator(self.seed, *key), self.specials,
                                             candidate=torch.from_numpy(pieces))
        nsp = torch.from_numpy(self._nsp[indices].astype(np.int64)) if self.pairs else None
        labels = torch.from_numpy(self.labels[indices]) if self.labels is not None else None
        if self.tags is not None:
            labels = torch.from_numpy(self._tag_rows(indices, width))
        spans = None if self.spans is None else torch.from_numpy(self.spans[indices])
        return EncoderBatch(tokens, torch.from_numpy(segments), mlm_labels, nsp, labels,
                            torch.from_numpy(np.asarray(indices, dtype=np.int64)), spans)

    def _tag_rows(self, indices: np.ndarray, width: int) -> np.ndarray:
        """(B, T) int64: each item's tags at its pieces (cropped as its ids), IGNORE at
        [CLS], [SEP] and padding."""
        rows = np.full((len(indices), width), IGNORE, dtype=np.int64)
        for row, index in enumerate(indices):
            kept = self.tags[index][:min(len(self.tags[index]), self.max_len - 2)]
            rows[row, 1:1 + len(kept)] = kept
        return rows

    def _second(self, index: int) -> np.ndarray | None:
        """Item `index`'s B: its pair's (NSP), its given second text, or None."""
        if self.pairs:
            return self.ids[self._partners[index]]
        return None if self.second_ids is None else self.second_ids[index]

    def iterate_keyed(self, epoch: int = 0):
        """The batches of an epoch, masked with the keys the loop would use (dev
        evaluation: the same masks at every evaluation)."""
        for position, indices in enumerate(self.epoch_batches(epoch)):
            yield self.collate(indices, (epoch, position))

    def padding_fraction(self, epoch: int = 0) -> float:
        batches = self.epoch_batches(epoch)
        padded = sum(len(b) * int(self.lengths[b].max()) for b in batches)
        return 1.0 - float(sum(self.lengths[b].sum() for b in batches)) / padded
