"""Beam search over a batch that sentences join and leave between steps: continuous
batching, what a server needs when requests keep arriving.

A static batch lasts as long as its longest sentence, and requests that arrive meanwhile
wait for all of it. Here each step decodes the sentences that are running; one that is
done leaves at once, and new ones join before any step (`add`), so the batch stays full.

Rows are aligned by cache slot, as left-padded prompts are (model/decoder_only.py): a
sentence that joins when the caches hold t slots feeds its bos at slot t, its rows
attend to slots t and later only, and its positions count from t. Sentences keep the
order they joined in, so the rows of those that joined at one step are a run with one
first slot: through a decoding copy's written-out step (model/decoder_step.py), each
run's self-attention reads its own slots and no others (in a stream of sentences
joining one or two at a time, reading from the oldest sentence's bos read 2.5x the
keys). Through the modules, every row reads from the oldest running sentence's bos on,
what it does not own masked. Slots before the oldest bos are never read; when the slots
run out they are dropped (compaction), and the buffers grow (doubling) when a sentence
needs more rows or slots. A beam that changes rows takes its sentence's slots along, not
the slots before its bos.

A sentence may be given a token after bos (a multilingual model's target language,
search.forced_start): its bos goes through the decoder as it joins, into the slot
before the next step's, which feeds the given token (an empty search starts a slot
later for it), and its search counts from the token after.

Each sentence is searched as `beam_search` searches it alone: the same extensions,
finished lists, length penalty and stopping rules (search.py), by its own step count.
Only numerics may differ: masked keys, and rows decoded in other company, can change
the order in which a kernel sums (last-bit differences; tested equal on real outputs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from transduce.attention.kv_cache import Int4KVCache, KVCache, QuantizedKVCache
from transduce.decode.search import (Hypothesis, best_extensions, fill_holes, finish_eos,
                                     finish_live, forbid_doubles, length_penalty, max_lengths,
                                     sentence_done)
from transduce.model.transformer import Transformer


@dataclass
class _Sentence:
    tag: Any                  # the caller's handle, given back with the result
    offset: int               # the cache slot of its bos
    limit: int                # its most output tokens
    given: int = 0            # tokens after bos that were given, not searched (0 or 1)
    finished: list[Hypothesis] = field(default_factory=list)


def supports(model: Any, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether `model` can decode continuously with caches of `cache_dtype`: an
    encoder-decoder Transformer whose self-attention caches hold softmax attention's
    keys and values over every token, as they are or quantized (int8, int4). (Sized for
    the longest output: a sliding window's cache is a plain one for outputs within it.)"""
    if not isinstance(model, Transformer):
        return False
    caches = model.new_caches(1, model.config.max_positions, cache_dtype or torch.float32,
                              "meta")
    return all(type(cache) in (KVCache, QuantizedKVCache, Int4KVCache) for cache in caches)


def slot_buffers(caches: list[KVCache]) -> list[tuple[Tensor, ...]]:
    """Per layer its cache's buffers (R, Hkv, T, ...): keys, values (and their scales),
    which a continuous search holds and points its caches at."""
    return [tuple(getattr(cache, name) for name in cache._buffers) for cache in caches]


def view_slots(caches: list[KVCache], buffers: list[tuple[Tensor, ...]], rows: slice,
               start: int, length: int) -> None:
    """Point every cache at rows `rows` of its buffers from slot `start` on, `length`
    slots of them filled."""
    for cache, held in zip(caches, buffers):
        for name, buffer in zip(cache._buffers, held):
            setattr(cache, name, buffer[rows, :, start:])
        cache.length = length


class ContinuousBeamSearch:
    """Beam search (beam, alpha, nbest, max_len as in beam_search) on sentences that join
    with add() and leave as step() finds them done.

        search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS)
        search.add(src, tags)                # src (N, S) right-padded ids
        while search.running:
            for tag, hypotheses in search.step():   # the sentences done at this step
                ...
    """

    def __init__(self, model: Transformer, *, bos_id: int, eos_id: int, beam: int = 4,
                 alpha: float = 0.6, nbest: int = 1, max_len: int | None = None,
                 cache_dtype: torch.dtype | None = None, no_doubles: bool = False):
        """cache_dtype: the self-attention caches' (torch.int8, torch.int4: quantized;
        None: the model's); no_doubles: a token never directly follows itself
        (search.forbid_doubles)."""
        if not supports(model, cache_dtype):
            raise ValueError(f"{type(model).__name__} cannot decode continuously: it needs an "
                             "encoder-decoder Transformer with softmax attention's KV caches")
        if not 1 <= nbest <= beam:
            raise ValueError(f"nbest={nbest} must be between 1 and beam={beam}")
        self.model, self.bos_id, self.eos_id = model, bos_id, eos_id
        self.beam, self.alpha, self.nbest, self.max_len = beam, alpha, nbest, max_len
        self.no_doubles = no_doubles
        c = model.config
        self.dtype = model.decoder.embed.embedding.weight.dtype     # the decoding copy's
        self.device = model.decoder.embed.embedding.weight.device
        self.sentences: list[_Sentence] = []        # running, in row order
        self.slot = 0                                # the slot the next step writes
        # Buffers at capacity; the running rows are their first ones. Sized by _grow.
        self.caches = model.new_caches(0, 0, cache_dtype or self.dtype, self.device)
        self._keys = slot_buffers(self.caches)
        empty = torch.zeros(0, c.kv_heads, 0, c.head_dim, dtype=self.dtype, device=self.device)
        self._memory = [(empty, empty.clone()) for _ in self.caches]    # (A, Hkv, S, D)
        self._memory_mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # (A, S)
        self._history = torch.zeros(0, 0, dtype=torch.long, device=self.device)      # (R, T)
        self._offsets = torch.zeros(0, dtype=torch.long, device=self.device)         # (A,)
        self._scores = torch.zeros(0, beam, device=self.device)                     # (A, K)
        self._source_width = 0     # the widest running source: what cross-attention reads

    @property
    def running(self) -> int:
        """Sentences being searched."""
        return len(self.sentences)

    @torch.inference_mode()
    def add(self, src: Tensor, tags: list[Any], forced: Tensor | None = None) -> None:
        """Start searching sentences src (N, S) (right-padded ids, each ending in eos) at the
        next step; tags come back with their results. forced: (N,) the token each output
        starts with after bos, given rather than searched."""
        if src.dim() != 2 or src.shape[0] != len(tags) or src.shape[0] == 0:
            raise ValueError(f"src {tuple(src.shape)} must be (N, S) with one tag per row "
                             f"({len(tags)} tags), N >= 1")
        if forced is not None and tuple(forced.shape) != (src.shape[0],):
            raise ValueError(f"forced {tuple(forced.shape)} must be (N,): one token per "
                             f"sentence")
        src = src.to(self.device)
        new, width = src.shape
        first, first_row = len(self.sentences), len(self.sentences) * self.beam
        given = 0 if forced is None else 1
        limits = max_lengths(self.model, src, self.max_len, given).tolist()
        self._make_room(first + new, width, self.slot + 1)
        if given and self.slot == 0:         # bos needs a slot before the next step's
            self._make_room(first + new, width, 2)
            self._start_a_slot_later()

        src_mask = self.model.source_mask(src)                           # (N, 1, 1, S)
        memory_kv = self.model.decoder.memory_kv(self.model.encode(src, src_mask))
        for (k_buffer, v_buffer), (k, v) in zip(self._memory, memory_kv):
            k_buffer[first:first + new, :, :width] = k
            v_buffer[first:first + new, :, :width] = v
        self._memory_mask[first:first + new] = False
        self._memory_mask[first:first + new, :width] = src_mask.view(new, width)
        self._source_width = max(self._source_width, width)

        rows, bos_slot = slice(first_row, first_row + new * self.beam), self.slot - given
        self._history[rows, bos_slot] = self.bos_id
        if forced is not None:
            self._history[rows, self.slot] = forced.to(self.device).repeat_interleave(self.beam)
            self._decode_bos(first, new, width, bos_slot)
        self._offsets[first:first + new] = bos_slot
        self._scores[first:first + new] = float("-inf")
        self._scores[first:first + new, 0] = 0.0     # one live beam at first, as beam_search
        self.sentences += [_Sentence(tag, bos_slot, limit, given)
                           for tag, limit in zip(tags, limits)]

    def _start_a_slot_later(self) -> None:
        """Move the next step to slot 1: the sentences waiting for it (at slot 0, none
        fed yet, as the slot is 0) feed their bos there instead."""
        rows = len(self.sentences) * self.beam
        self._history[:rows, 1] = self._history[:rows, 0]
        self._offsets[:len(self.sentences)] += 1
        for sentence in self.sentences:
            sentence.offset += 1
        self.slot = 1

    def _decode_bos(self, first: int, new: int, width: int, slot: int) -> None:
        """The bos of sentences [first:first + new] through the decoder, into `slot` of
        their rows' caches (position 0); their logits are not needed."""
        rows = slice(first * self.beam, (first + new) * self.beam)
        view_slots(self.caches, self._keys, rows, slot, 0)
        memory_kv = [(k[first:first + new, :, :width], v[first:first + new, :, :width])
                     for k, v in self._memory]
        memory_mask = self._memory_mask[first:first + new, None, None, :width]
        tokens = self._history[rows, slot:slot + 1]                        # (N * K, 1)
        self.model.decoder(tokens, memory_kv, memory_mask, caches=self.caches,
                           positions=torch.zeros_like(tokens))

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, list[Hypothesis]]]:
        """One token for every running beam -> (tag, nbest hypotheses, best first) of each
        sentence done at this step, which leaves the batch."""
        if not self.sentences:
            return []
        sentences, beam, slot = len(self.sentences), self.beam, self.slot
        rows = sentences * beam
        logits = self._decode(rows, slot)                                # (R, V)
        if self.no_doubles:
            forbid_doubles(logits, self._history[:rows, slot])
        scores = self._scores[:sentences]
        top = best_extensions(logits, scores, beam, self.eos_id)
        steps = [slot + 1 - s.offset - s.given for s in self.sentences]  # tokens so far
        penalties = [length_penalty(n, self.alpha) for n in steps]
        history, running = self._history, self.sentences

        def prefix(row: int) -> list[int]:
            sentence = running[row // beam]
            return history[row, sentence.offset + 1 + sentence.given:slot + 1].tolist()

        finish_eos(top, prefix, [s.finished for s in self.sentences], beam, penalties)
        best_live = top.next_scores.max(dim=1).values.tolist()
        kept, done = [], []
        for row, sentence in enumerate(self.sentences):
            if steps[row] >= sentence.limit:
                finish_live(top, row, prefix, sentence.finished, beam, penalties[row])
                done.append(sentence)
            elif sentence_done(sentence.finished, best_live[row], beam, self.nbest,
                               self.alpha, sentence.limit):
                done.append(sentence)
            else:
                kept.append(row)
        self._keep(kept, top, sentences, slot)
        return [(s.tag, sorted(s.finished, key=lambda h: h.score, reverse=True)[:self.nbest])
                for s in done]

    def _decode(self, rows: int, slot: int) -> Tensor:
        """The running rows' tokens at `slot` through the decoder -> logits (R, V).
        The caches are views from the oldest bos on: slots before it are never read."""
        first = self._oldest_bos()
        view_slots(self.caches, self._keys, slice(0, rows), first, slot - first)
        sentences, beam, width = rows // self.beam, self.beam, self._source_width
        memory_kv = [(k[:sentences, :, :width], v[:sentences, :, :width])
                     for k, v in self._memory]
        memory_mask = self._memory_mask[:sentences, None, None, :width]   # (A, 1, 1, S)
        offsets = self._offsets[:sentences]                                # (A,)
        positions = (slot - offsets).repeat_interleave(beam)[:, None]      # (R, 1)
        tokens = self._history[:rows, slot:slot + 1]
        decoder = self.model.decoder
        if decoder.fast_step is not None and decoder.fast_step.covers(tokens, self.caches):
            lengths = self._memory_mask[:sentences, :width].sum(dim=1)      # right-padded
            hidden = decoder.fast_step(tokens, memory_kv, memory_mask, None, self.caches,
                                       positions, row_runs=self._row_runs(first),
                                       memory_lengths=lengths)
            return self.model.output_proj(hidden)[:, -1]
        key_mask = None           # all rows from the same bos: nothing to hide
        if any(s.offset != first for s in self.sentences):
            seen = torch.arange(first, slot + 1, device=self.device) >= offsets[:, None]
            key_mask = seen[:, None, :].expand(-1, beam, -1).reshape(rows, 1, 1, -1)
        hidden = decoder(tokens, memory_kv, memory_mask, tgt_mask=key_mask, caches=self.caches,
                         positions=positions)
        return self.model.output_proj(hidden)[:, -1]

    def _row_runs(self, first: int) -> list[tuple[int, int, int]]:
        """(first row, end row, first slot of the cache views) of each run of sentences
        that joined at the same step: their rows read their own slots only."""
        runs: list[tuple[int, int, int]] = []
        for index, sentence in enumerate(self.sentences):
            row, start = index * self.beam, sentence.offset - first
            if runs and runs[-1][2] == start:
                runs[-1] = (runs[-1][0], row + self.beam, start)
            else:
                runs.append((row, row + self.beam, start))
        return runs

    def _keep(self, kept: list[int], top, sentences: int, slot: int) -> None:
        """Carry the kept sentences' best beams to the next slot, in rows [:len(kept) * K];
        the sentences done leave (only the rows that move are copied)."""
        beam = self.beam
        if len(kept) < sentences:
            kept = fill_holes(kept)
        self.sentences = [self.sentences[row] for row in kept]
        self.slot = slot + 1
        if not kept:
            self.slot, self._source_width = 0, 0
            return
        index = torch.tensor(kept, device=self.device)
        source_rows = (index[:, None] * beam + top.next_beam[index]).view(-1)   # (A' * K)
        self._move_rows(source_rows, self._offsets[index].repeat_interleave(beam), slot + 1)
        self._scores[:len(kept)] = top.next_scores[index]
        if len(kept) < sentences:
            for k, v in self._memory:
                _rearrange(k[:, :, :self._source_width], index)
                _rearrange(v[:, :, :self._source_width], index)
            _rearrange(self._memory_mask, index)
            _rearrange(self._offsets, index)
            self._source_width = int(self._memory_mask[:len(kept)].any(dim=0).nonzero().max()) + 1
        self._make_room(len(kept), 0, self.slot + 1)     # may compact: self.slot moves
        self._history[:len(source_rows), self.slot] = top.next_token[index].view(-1)

    def _oldest_bos(self) -> int:
        """The slot of the oldest running sentence's bos: no row reads before it (the
        current slot when none runs)."""
        return min((s.offset for s in self.sentences), default=self.slot)

    def _move_rows(self, source_rows: Tensor, starts: Tensor, end: int) -> None:
        """Target row i takes what row source_rows[i] held in slots [starts[i]:end]: its
        sentence's own, from its bos on (no row reads before its bos). Only the rows that
        move are copied, as (row, slot) cells of the whole buffers, every row's at once."""
        moved = (source_rows != torch.arange(len(source_rows), device=self.device)).nonzero()
        if not moved.numel():
            return
        moved = moved.squeeze(1)
        rows, slots = _cells(moved, starts[moved], end)                    # (N,), (N,)
        sources, held_slots = source_rows[rows], self._history.shape[1]
        _copy_cells(self._history.view(-1), rows * held_slots + slots,
                    sources * held_slots + slots)
        heads = torch.arange(self._keys[0][0].shape[1], device=self.device)          # (Hkv,)

        def cells(rows: Tensor) -> Tensor:   # (N,) -> (N * Hkv,) rows of (R * Hkv * T, D)
            return ((rows[:, None] * len(heads) + heads) * held_slots + slots[:, None]).view(-1)

        target, source = cells(rows), cells(sources)
        for buffer in itertools.chain.from_iterable(self._keys):
            _copy_cells(buffer.view(-1, buffer.shape[-1]), target, source)

    def _make_room(self, sentences: int, width: int, slots: int) -> None:
        """Buffers for `sentences` sentences, sources `width` wide and `slots` slots: drop
        the slots before every running sentence's bos when slots run out; grow what is
        still too small."""
        held_rows, held_slots = self._history.shape
        first = self._oldest_bos()
        if first and slots > held_slots:
            self._compact(first)
            slots -= first
        rows = sentences * self.beam
        if rows > held_rows or slots > held_slots \
                or width > self._memory_mask.shape[1] or sentences > self._memory_mask.shape[0]:
            self._grow(sentences, width, slots)

    def _compact(self, first: int) -> None:
        """Drop slots [:first], which no running sentence attends."""
        rows, end = len(self.sentences) * self.beam, self.slot   # slots written so far
        for buffer in itertools.chain.from_iterable(self._keys):
            buffer[:rows, :, :end - first] = buffer[:rows, :, first:end].clone()
        self._history[:rows, :end - first] = self._history[:rows, first:end].clone()
        self._offsets[:len(self.sentences)] -= first
        for sentence in self.sentences:
            sentence.offset -= first
        self.slot -= first

    def _grow(self, sentences: int, width: int, slots: int) -> None:
        """Reallocate every buffer at least twice as large where it is too small, keeping
        what the running rows hold."""
        def size(needed: int, held: int) -> int:
            return held if needed <= held else max(needed, 2 * held, 8)

        held_rows, held_slots = self._history.shape
        held_sentences, held_width = self._memory_mask.shape
        n_rows, n_slots = size(sentences * self.beam, held_rows), size(slots, held_slots)
        n_sentences, n_width = size(sentences, held_sentences), size(width, held_width)
        self._keys = [tuple(_resized(b, (n_rows, b.shape[1], n_slots, b.shape[3]))
                            for b in buffers) for buffers in self._keys]
        self._memory = [(_resized(k, (n_sentences, k.shape[1], n_width, k.shape[3])),
                         _resized(v, (n_sentences, v.shape[1], n_width, v.shape[3])))
                        for k, v in self._memory]
        self._memory_mask = _resized(self._memory_mask, (n_sentences, n_width))
        self._history = _resized(self._history, (n_rows, n_slots))
        self._offsets = _resized(self._offsets, (n_sentences,))
        self._scores = _resized(self._scores, (n_sentences, self.beam))


def _resized(buffer: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A zero-filled buffer of `shape` holding `buffer`'s values at its corner. Zeros,
    not garbage: masked keys still enter the attention's products."""
    if tuple(buffer.shape) == shape:
        return buffer
    new = torch.zeros(shape, dtype=buffer.dtype, device=buffer.device)
    new[tuple(slice(0, n) for n in buffer.shape)] = buffer
    return new


def _cells(rows: Tensor, starts: Tensor, end: int) -> tuple[Tensor, Tensor]:
    """rows (N,) with their first slots (N,) -> every (row, slot) with slot in
    [start:end), as rows (M,) and slots (M,)."""
    lengths = end - starts
    total = int(lengths.sum())
    before = (lengths.cumsum(0) - lengths).repeat_interleave(lengths, output_size=total)
    slots = starts.repeat_interleave(lengths, output_size=total) \
        + torch.arange(total, device=rows.device) - before
    return rows.repeat_interleave(lengths, output_size=total), slots


def _copy_cells(buffer: Tensor, target: Tensor, source: Tensor) -> None:
    """buffer[target] = buffer[source] along the first dimension (every source read
    before any target is written)."""
    buffer.index_copy_(0, target, buffer.index_select(0, source))


def _rearrange(buffer: Tensor, index: Tensor) -> None:
    """buffer[:len(index)] = buffer[index] in place (buffer may be a view), copying only
    the rows that move."""
    moved = (index != torch.arange(index.numel(), device=index.device)).nonzero().squeeze(1)
    if moved.numel():
        buffer.index_copy_(0, moved, buffer.index_select(0, index[moved]))
