"""Generation over a batch that prompts join and leave between steps: continuous
batching for a decoder-only model, what a server needs when requests keep arriving.

A static batch of prompts lasts as long as its longest continuation, and requests that
arrive meanwhile wait for all of it. Here each step feeds one token to every running
row; a row that is done (eos, a stop string, its limit) leaves at once, and new prompts
join before any step (`add`), so the batch stays full.

Rows are aligned by cache slot, as in the continuous beam search (continuous.py): a step
writes every row's token at one slot. A prompt of P tokens that joins when the next step
writes slot t has its first P - 1 tokens cached at slots t - P + 1 .. t - 1 of its own
rows, and its last token is fed at slot t with everyone's. The prompts that join
together are prefilled in groups of near lengths (length_groups): one left-padded pass
would make every prompt as long as the longest. Its positions count from its first
slot, and it attends to its own slots only, so it generates what it would alone: in
float32 each row reads just those (the one-query kernel, attention/one_query.py, as the
continuous beam search does), elsewhere the window from the oldest row's first slot
under a mask. int8 and int4 caches hold their scales in slot buffers of their own,
moved with the keys and values. A sliding window (Mistral's) is a band of slots, the
same for every row: a row reads from its own first slot or the window's, whichever is
later. Slots before the oldest running row's first are never read; when the buffers
lack room (for more rows, a longer prompt, the next slot) they are laid out again from
that slot, with twice the room needed, so that this is rare. (A window's older slots
are kept until then too: the buffers hold what softmax attention's would.) Where
sliding layers mix with full ones (Gemma 2's and 3's), the sliding layers' caches
(BandedKVCache) keep their band themselves: in float32 (or an int8 copy's float32
caches) each row reads its own slots from its first or the band's, whichever is later
(the one-query kernel again), elsewhere every layer reads from the oldest row's first
slot under the key mask.

Each row is generated as Generator.generate generates it alone, with its own settings
(prompts of any settings share the batch): greedy, or sampled at its temperature, top_k
and top_p from a generator of its own seeded with its seed, with its repetition,
frequency and presence penalties and logit bias over its own tokens, and its stop
strings and limit. Only numerics may differ: masked keys, the kernel, and rows decoded
in other company can change the order in which a kernel sums.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
from torch import Tensor

from transduce.attention.kinds import SoftmaxAttention
from transduce.attention.kv_cache import KVCache
from transduce.attention.local import BandedKVCache, SlidingKVCache
from transduce.decode.constrained import constrained
from transduce.decode.continuous import slot_buffers, view_slots
from transduce.decode.generate import Continuation, Generator, left_pad
from transduce.decode.options import GenerateOptions
from transduce.decode.penalties import Penalties
from transduce.decode.sampling import Sampler
from transduce.model.decoder_only import DecoderOnly, LMState

MIN_SLOTS = 32     # the fewest slots a layout allocates
# A prefill group's rows, padded to its longest prompt, compute at most this many
# positions per real one, or this many padding positions more: on gpt-small's shape
# another pass cost as much as 64 to 128 padded positions (2-core Xeon, bfloat16 and
# float32, one long prompt joining 1 or 7 short ones).
PREFILL_SLACK, PREFILL_SPARE = 1.25, 128


@dataclass
class _Row:
    tag: Any                       # the caller's handle, given back with the result
    continuation: Continuation
    generator_id: int              # its random generator's id in its sampler
    sampling: Hashable             # (temperature, top_k, top_p, min_p), None when greedy


def supports(generator: Generator) -> bool:
    """Whether `generator` can generate continuously: a PyTorch model (not an ONNX
    export) whose caches hold keys and values, as they are or quantized (softmax
    attention, or a sliding window, whose band the slots' mask keeps, the same on every
    layer); or, in float caches, sliding layers among full ones (Gemma's), whose band
    their caches keep (BandedKVCache)."""
    if not isinstance(generator.model, DecoderOnly):
        return False
    caches = generator.model.new_caches(1, 1, generator.cache_dtype or torch.float32, "meta")
    if generator.model.config.full_attention_layers:
        return all(type(cache) in (KVCache, SlidingKVCache) for cache in caches)
    return all(isinstance(cache, (KVCache, SlidingKVCache)) for cache in caches)


def _window(model: DecoderOnly) -> int | None:
    """The keys before its own that a token attends to on every layer (None: all of them,
    on some layers at least)."""
    c = model.config
    return c.attention_window if c.attention_type == "sliding" \
        and not c.full_attention_layers else None


def _slot_caches(model: DecoderOnly, dtype: torch.dtype, device: torch.device | str
                 ) -> list[KVCache]:
    """Softmax attention's cache per layer (KVCache, or QuantizedKVCache / Int4KVCache
    for int8 and int4), whose buffers _decode points at the slots: a window on every
    layer is a band of slots in the mask, the same for every row; a window on some is
    their caches' own band (BandedKVCache), the others reading every slot."""
    c = model.config
    return [BandedKVCache(0, c.kv_heads, 0, c.head_dim, window=c.attention_window,
                          dtype=dtype, device=device)
            if c.full_attention_layers and c.layer_attention_type(layer) == "sliding"
            else SoftmaxAttention().new_cache(0, c.kv_heads, c.head_dim, 0, dtype, device)
            for layer in range(len(model.decoder.layers))]


def _prefilled(cache: KVCache | SlidingKVCache) -> list[Tensor]:
    """A prefilled cache's buffers (keys and values, and their scales where quantized)
    over its latest tokens (N, Hkv, n, ...): all of them, or the window's."""
    buffers = [getattr(cache, name) for name in cache._buffers]
    return buffers if isinstance(cache, SlidingKVCache) else \
        [buffer[:, :, :cache.length] for buffer in buffers]


class ContinuousGeneration:
    """Greedy or sampled generation (beam 1) of prompts that join with add() and leave as
    step() finds them done; `options` are the settings of prompts added without their own.

        generation = ContinuousGeneration(generator, options)
        generation.add(generator.encode(prompts), tags, seeds)   # seeds when sampling
        while generation.running:
            for tag, continuation in generation.step():     # the rows done at this step
                print(continuation.text)
    """

    def __init__(self, generator: Generator, options: GenerateOptions = GenerateOptions()):
        _check_beam(options)
        if not supports(generator):
            raise ValueError("this generator cannot generate continuously: it needs the "
                             "KV caches of softmax or sliding-window attention (float "
                             "ones where the two kinds mix)")
        self.generator, self.options, self.model = generator, options, generator.model
        self.device, self.window = generator.device, _window(generator.model)
        self.rows: list[_Row] = []                   # running, in row order
        self.slot = 0                                # the slot the next step writes
        self.cache_dtype = generator.cache_dtype or self.model.decoder.embed.embedding.weight.dtype
        self.caches = _slot_caches(self.model, self.cache_dtype, self.device)
        self._banded = any(type(cache) is BandedKVCache for cache in self.caches)
        self._keys = slot_buffers(self.caches)
        self._tokens = torch.zeros(0, dtype=torch.long, device=self.device)   # (R,) fed next
        self._starts = torch.zeros(0, dtype=torch.long, device=self.device)   # (R,)
        self._penalties: Penalties | None = None     # once a row has a penalty or bias
        self._seeds: dict[int, int] = {}             # generator id -> seed
        self._ids = itertools.count()
        self.samplers: dict[Hashable, Sampler] = {}  # sampling settings -> their sampler

    @property
    def running(self) -> int:
        """Prompts being continued."""
        return len(self.rows)

    def continuations(self) -> list[tuple[Any, Continuation]]:
        """(tag, continuation so far) of every running row, in row order."""
        return [(row.tag, row.continuation) for row in self.rows]

    @torch.inference_mode()
    def add(self, prompts: Sequence[Sequence[int]], tags: Sequence[Any],
            seeds: Sequence[int | None] | None = None,
            options: GenerateOptions | Sequence[GenerateOptions] | None = None) -> None:
        """Start continuing prompts (ids as Generator.encode gives them) at the next step;
        tags come back with their continuations. options: the prompts' settings, one for
        all or one each (None: the generation's); seeds: one per prompt, an integer for
        each sampled one (None for a greedy one)."""
        prompts = [ids if isinstance(ids, list) else list(ids) for ids in prompts]  # ReplyIds
        settings = self._settings(prompts, tags, seeds, options)
        first, count, before = len(self.rows), len(prompts), max(map(len, prompts)) - 1
        self._make_room(first + count, before)
        rows = slice(first, first + count)
        if before:
            self._prefill(prompts, first)
        lengths = torch.tensor([len(ids) for ids in prompts], device=self.device)
        self._starts[rows] = self.slot - (lengths - 1)
        self._tokens[rows] = torch.tensor([ids[-1] for ids in prompts], device=self.device)
        self._note_penalties(prompts, settings, first)
        for index, (ids, tag, each) in enumerate(zip(prompts, tags, settings)):
            generator_id, sampling = next(self._ids), None
            if not each.greedy:
                sampling = (each.temperature, each.top_k, each.top_p, each.min_p)
                self._seeds[generator_id] = seeds[index]
                if sampling not in self.samplers:
                    self.samplers[sampling] = Sampler(
                        each.temperature, each.top_k, each.top_p, device=self.device,
                        row_seeds=self._seeds, min_p=each.min_p)
            self.rows.append(_Row(tag, self.generator.continuation(ids, each), generator_id,
                                  sampling))

    def _settings(self, prompts: list[list[int]], tags: Sequence[Any],
                  seeds: Sequence[int | None] | None,
                  options: GenerateOptions | Sequence[GenerateOptions] | None
                  ) -> list[GenerateOptions]:
        """Each prompt's options, once the arguments are checked (a ValueError names what
        is wrong)."""
        count = len(prompts)
        if not prompts or len(tags) != count:
            raise ValueError(f"{count} prompts and {len(tags)} tags: give one tag per "
                             "prompt, and at least one prompt")
        if options is None or isinstance(options, GenerateOptions):
            settings = [options or self.options] * count
        else:
            settings = list(options)
        if len(settings) != count:
            raise ValueError(f"{count} prompts and {len(settings)} options: give one for "
                             "all, or one per prompt")
        for each in settings:
            _check_beam(each)
            self.generator.check_vocabulary(each)
        given = [None] * count if seeds is None else list(seeds)
        if len(given) != count or any((seed is None) != each.greedy
                                      for seed, each in zip(given, settings)):
            raise ValueError("give one seed per prompt when sampling, and none when greedy")
        too_long = [len(ids) for ids in prompts if not 1 <= len(ids) < self.generator.context]
        if too_long:
            raise ValueError(f"a prompt of {too_long[0]} tokens: each needs 1 to "
                             f"{self.generator.context - 1}")
        return settings

    def _note_penalties(self, prompts: list[list[int]], settings: list[GenerateOptions],
                        first: int) -> None:
        """The joining rows' penalties and biases, and the tokens of their prompts (the
        buffers are made when the first row with one joins; rows without one are left
        as they are, penalties off)."""
        if self._penalties is None:
            if not any(each.penalized for each in settings):
                return
            self._penalties = Penalties(self._tokens.shape[0],
                                        self.model.config.tgt_vocab_size, self.device)
        self._penalties.start(first, prompts, settings)

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, Continuation]]:
        """One token for every running row -> (tag, continuation) of each row done at this
        step, which leaves the batch."""
        if not self.rows:
            return []
        count = len(self.rows)
        self._make_room(count, 0)
        logits = self._decode(count)                                        # (R, V)
        if self._penalties is not None:
            logits = self._penalties(logits)
        logits = constrained(logits, [row.continuation.grammar for row in self.rows])
        chosen = self._choose(logits)                                       # (R,)
        self._tokens[:count] = chosen
        if self._penalties is not None:
            self._penalties.record(chosen)
        for row, token in zip(self.rows, chosen.tolist()):
            row.continuation.add(token)         # finished at eos, a stop or its limit
        self.slot += 1
        done = [row for row in self.rows if row.continuation.finished]
        if done:
            self._keep([index for index, row in enumerate(self.rows)
                        if not row.continuation.finished])
        return [(row.tag, row.continuation) for row in done]

    def _choose(self, logits: Tensor) -> Tensor:
        """Each row's next token, by its own settings: logits (R, V) -> tokens (R,). The
        rows of each setting are chosen together."""
        groups: dict[Hashable, list[int]] = {}
        for index, row in enumerate(self.rows):
            groups.setdefault(row.sampling, []).append(index)
        if len(groups) == 1:
            return self._chosen(logits, next(iter(groups)), self.rows)
        chosen = torch.empty(len(self.rows), dtype=torch.long, device=self.device)
        for sampling, indices in groups.items():
            index = torch.tensor(indices, device=self.device)
            chosen[index] = self._chosen(logits[index], sampling,
                                         [self.rows[i] for i in indices])
        return chosen

    def _chosen(self, logits: Tensor, sampling: Hashable, rows: list[_Row]) -> Tensor:
        """logits (N, V) of `rows`, which share `sampling` -> tokens (N,)."""
        if sampling is None:
            return logits.argmax(dim=-1)
        return self.samplers[sampling](logits, [row.generator_id for row in rows])

    def _decode(self, count: int) -> Tensor:
        """The running rows' tokens at self.slot through the model -> logits (R, V). The
        caches are views from the oldest row's first slot on (or the window's first, if
        later); a row reads from its own first slot or the window's (reads_from)."""
        starts = self._starts[:count]
        first = int(starts.min())
        if self.window is not None:
            first = max(first, self.slot - self.window)
        view_slots(self.caches, self._keys, slice(0, count), first, self.slot - first)
        tokens, offsets = self._tokens[:count, None], starts - first          # (R, 1), (R,)
        reads_from = offsets if self.window is None else offsets.clamp(min=0)
        runs, step = _runs(reads_from.tolist()), self.model.decoder.fast_step
        if (len(runs) > 1 or self._banded) and step is not None \
                and step.reads_rows_by_kernel(self.cache_dtype) \
                and step.covers(tokens, self.caches, runs=True):
            # Each row reads its own slots only (the one-query kernel), not the window
            # from the oldest row's first slot that a mask would hide it from. (Rows of
            # one start take the unmasked path below, exactly what they do alone, but
            # where banded caches would send it through the modules.)
            positions = (self.slot - starts)[:, None]                             # (R, 1)
            hidden = step(tokens, None, None, None, self.caches, positions, row_runs=runs)
            return self.model.logits(hidden)[:, -1].float()
        slots = torch.arange(self.caches[0].max_len, device=self.device)
        key_mask = slots[None, :] >= reads_from[:, None]                    # (R, T)
        state = LMState(self.caches, key_mask, offsets)
        return self.model.decode_step(tokens, state)[:, -1].float()

    def _prefill(self, prompts: list[list[int]], first: int) -> None:
        """Cache every prompt's tokens but its last, right-aligned to end at slot - 1, in
        rows first, first + 1, ...: a pass for each group of near lengths."""
        for group in length_groups([len(ids) - 1 for ids in prompts]):
            before = len(prompts[group[0]]) - 1                      # the group's longest
            if not before:
                continue
            prompt, mask = left_pad([prompts[i] for i in group], self.model.config.pad_id,
                                    self.device)                                  # (N, P)
            state = self.model.prefill(prompt, 0, src_mask=mask, cache_dtype=self.cache_dtype)
            rows = torch.tensor([first + i for i in group], device=self.device)
            for buffers, cache in zip(self._keys, state.caches):
                for buffer, held in zip(buffers, _prefilled(cache)):    # (N, Hkv, n, ...)
                    buffer[rows, :, self.slot - held.shape[2]:self.slot] = held

    def _keep(self, kept: list[int]) -> None:
        """Keep rows `kept` at the top of the buffers and forget the others: the kept
        rows past the new end move into the holes, so that a step copies the caches
        of as many rows as finished at most, not of every row after the first done."""
        staying = set(kept)
        for index, row in enumerate(self.rows):
            if index not in staying and row.sampling is not None:
                self.samplers[row.sampling].forget([row.generator_id])
                del self._seeds[row.generator_id]
        count = len(kept)
        holes = [index for index in range(count) if index not in staying]
        movers = [index for index in kept if index >= count]        # as many as holes
        rows = self.rows
        for hole, mover in zip(holes, movers):
            rows[hole] = rows[mover]
        self.rows = rows[:count]
        in_use = {row.sampling for row in self.rows}
        self.samplers = {key: sampler for key, sampler in self.samplers.items() if key in in_use}
        if not holes:
            return
        dst, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
        first = int(self._starts[src].min())
        for buffer in itertools.chain.from_iterable(self._keys):
            buffer[dst, :, first:self.slot] = buffer[src, :, first:self.slot]
        for buffer in (self._tokens, self._starts):
            buffer[dst] = buffer[src]
        if self._penalties is not None:
            self._penalties.move(dst, src)

    def _make_room(self, rows: int, before: int) -> None:
        """Buffers with room for `rows` rows, for `before` slots before self.slot and for
        self.slot itself: laid out again where they lack it."""
        have_rows, have_slots = self._keys[0][0].shape[0], self._keys[0][0].shape[2]
        if rows <= have_rows and before <= self.slot < have_slots:
            return
        count = len(self.rows)
        oldest = int(self._starts[:count].min()) if count else self.slot
        live = self.slot - oldest                     # slots the running rows still read
        lead = max(before, live)                      # the new layout's self.slot
        new_rows = rows if rows <= have_rows else max(rows, 2 * have_rows)
        new_rows = max(new_rows, have_rows)
        slots = max(2 * (lead + 1), MIN_SLOTS)
        moved = []
        for buffers in self._keys:
            layer = []
            for old in buffers:
                new = old.new_zeros(new_rows, old.shape[1], slots, old.shape[3])
                new[:count, :, lead - live:lead] = old[:count, :, oldest:self.slot]
                layer.append(new)
            moved.append(tuple(layer))
        self._keys = moved
        self._starts = self._starts + (lead - self.slot)
        self.slot = lead
        self._tokens, self._starts = _grown(self._tokens, new_rows), _grown(self._starts, new_rows)
        if self._penalties is not None:
            self._penalties.grow(new_rows)


def length_groups(lengths: Sequence[int], slack: float | None = None,
                  spare: int | None = None) -> list[list[int]]:
    """Indices of `lengths` grouped to be padded together, longest first in each group:
    a group padded to its first's length computes at most `slack` times its lengths'
    sum, or `spare` positions more (default: PREFILL_SLACK, PREFILL_SPARE)."""
    slack = PREFILL_SLACK if slack is None else slack
    spare = PREFILL_SPARE if spare is None else spare
    groups: list[list[int]] = []
    real = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            padded = lengths[groups[-1][0]] * (len(groups[-1]) + 1)
            total = real + lengths[index]
            if padded <= max(slack * total, total + spare):
                groups[-1].append(index)
                real = total
                continue
        groups.append([index])
        real = lengths[index]
    return groups


def _runs(offsets: list[int]) -> list[tuple[int, int, int]]:
    """Each row's first slot in the cache views -> (first row, end row, first slot) of
    the runs of consecutive rows that start at one slot (DecoderStep's row_runs)."""
    runs: list[tuple[int, int, int]] = []
    for row, start in enumerate(offsets):
        if runs and runs[-1][2] == start:
            runs[-1] = (runs[-1][0], row + 1, start)
        else:
            runs.append((row, row + 1, start))
    return runs


def _grown(buffer: Tensor, rows: int) -> Tensor:
    """`buffer` (R, ...) with its rows kept first and zeros up to `rows`."""
    if buffer.shape[0] == rows:
        return buffer
    grown = buffer.new_zeros(rows, *buffer.shape[1:])
    grown[:buffer.shape[0]] = buffer
    return grown


def _check_beam(options: GenerateOptions) -> None:
    if options.beam != 1:
        raise ValueError(f"beam={options.beam}: continuous generation is greedy or "
                         "sampled; beam search runs whole batches (Generator.generate)")
    if options.drafts:
        raise ValueError("prompt_lookup, draft_tokens: continuous generation steps every "
                         "row one token at a time; a speculative search runs each prompt "
                         "alone (Generator.generate)")
