"""Jobs decoded by continuous batching (batcher.py's Stream): every translation job's
sentences join one running beam search (decode/continuous.py), every generation job's
prompts one running generation (decode/continuous_generation.py), between steps, and a
job is answered as soon as its last sentence or prompt is done, not when the whole batch
is."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from transduce.data.tokenizer import BOS_ID, EOS_ID
from transduce.decode.continuous import ContinuousBeamSearch
from transduce.decode.continuous_generation import ContinuousGeneration, supports
from transduce.decode.generate import Generator
from transduce.decode.options import GenerateOptions
from transduce.decode.translate import Translation, Translator, pad_sources
from transduce.serve.batcher import Job, Stream
from transduce.serve.limits import Limits


def decodes_in_streams(model: Any, limits: Limits) -> bool:
    """Whether the server decodes `model`'s translations in continuous streams: a
    Translator that can, with batching on and continuous batching not turned off."""
    return isinstance(model, Translator) and model.decodes_continuously \
        and limits.batching and limits.continuous


def translation_stream(translator: Translator, beam: int, alpha: float, nbest: int,
                       max_length: int | None, processes: Mapping[int, Any] | None = None,
                       *, languages: tuple[str, str] | None = None, no_doubles: bool = False
                       ) -> Callable[[int], Stream] | None:
    """A factory of streams for these search settings and languages (a multilingual
    model's; called with the decoder's rank), or None where the translator cannot decode
    continuously (an ONNX export, an RNN, a sliding window or linear attention): its
    jobs are then decoded as whole batches. processes: by decoder rank, the
    DecoderProcess (processes.py) that decodes its streams; a decoder without one
    decodes them in its own thread."""
    if not translator.decodes_continuously:
        return None
    settings = (beam, alpha, nbest, max_length, languages, no_doubles)

    def stream(rank: int) -> Stream:
        if processes and rank in processes:
            return processes[rank].stream(*settings)
        return TranslationStream(translator, *settings)
    return stream


@dataclass
class _Pending:
    results: list[list[Translation]]     # per text, its hypotheses (empty texts: ready)
    waiting: int                         # texts still being searched
    started: float


class TranslationStream:
    """The Stream of one key's translation jobs. Each result is (per text, its nbest
    translations; the time the job was admitted; seconds until it was done), the form
    the routes' timings read (service.py)."""

    def __init__(self, translator: Translator, beam: int, alpha: float, nbest: int,
                 max_length: int | None, languages: tuple[str, str] | None = None,
                 no_doubles: bool = False):
        self.translator, self.nbest = translator, nbest
        self.way = translator.direction(*(languages or (None, None)))
        self.search = ContinuousBeamSearch(translator.model, bos_id=BOS_ID, eos_id=EOS_ID,
                                           beam=beam, alpha=alpha, nbest=nbest,
                                           max_len=max_length,
                                           cache_dtype=translator.cache_dtype,
                                           no_doubles=no_doubles)
        self.pending: dict[Job, _Pending] = {}
        self.ready: list[Job] = []             # done without a step: only empty texts

    @property
    def running(self) -> int:
        return len(self.pending)

    def admit(self, jobs: Sequence[Job]) -> None:
        now, rows, tags = time.monotonic(), [], []
        for job in jobs:
            ids = self.translator.encode(job.payload, prefix=self.way.source_prefix)
            empty = [Translation("", 0.0)] * self.nbest
            self.pending[job] = _Pending([empty for _ in ids], sum(1 for x in ids if x), now)
            if not self.pending[job].waiting:
                self.ready.append(job)
            for index, sentence in enumerate(ids):
                if sentence:
                    rows.append(sentence)
                    tags.append((job, index))
        if rows:
            forced = torch.tensor(self.way.forced * len(rows)) if self.way.forced else None
            self.search.add(pad_sources(rows, self.translator.device), tags, forced)

    def step(self) -> list[tuple[Job, Any]]:
        done, self.ready = self.ready, []
        decode = self.translator.tokenizer.target_tokenizer.decode
        for (job, index), hypotheses in self.search.step():
            pending = self.pending[job]
            pending.results[index] = [Translation(decode(h.tokens), h.score) for h in hypotheses]
            pending.waiting -= 1
            if not pending.waiting:
                done.append(job)
        now = time.monotonic()
        finished = [(job, self.pending.pop(job)) for job in done]
        return [(job, (p.results, p.started, now - p.started)) for job, p in finished]


def generation_stream(generator: Generator, options: GenerateOptions
                      ) -> Callable[[int], Stream] | None:
    """A factory of the stream that generates jobs of these settings (one stream takes
    jobs of any greedy or sampled settings), or None where they cannot be generated
    continuously (beam search, linear attention): their jobs are then
    generated as whole batches."""
    if options.beam != 1 or not supports(generator):
        return None
    return lambda rank: GenerationStream(generator)


@dataclass
class _Prompted:
    texts: list[Any]                     # per prompt, its result once done
    waiting: int                         # prompts still being continued
    started: float


class GenerationStream:
    """The Stream of generation jobs of any greedy or sampled settings, each prompt with
    its job's (payloads as serve/generation.py's Prompts). Each result is (per prompt its
    payload.result: the text, or a chat's reply; the time the job was admitted; seconds
    until done); a streamed job's pieces went out step by step before."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self.generation = ContinuousGeneration(generator)
        self.pending: dict[Job, _Prompted] = {}

    @property
    def running(self) -> int:
        return len(self.pending)

    def admit(self, jobs: Sequence[Job]) -> None:
        now, tags, seeds, options = time.monotonic(), [], [], []
        prompts = self.generator.encode([text for job in jobs for text in job.payload.texts])
        for job in jobs:
            count = len(job.payload.texts)
            self.pending[job] = _Prompted([""] * count, count, now)
            tags += [(job, index) for index in range(count)]
            seeds += job.payload.seeds or [None] * count
            options += [job.payload.options] * count
        if prompts:
            self.generation.add(prompts, tags, seeds, options)

    def step(self) -> list[tuple[Job, Any]]:
        done = []
        for (job, index), continuation in self.generation.step():
            pending = self.pending[job]
            pending.texts[index] = job.payload.result(continuation)
            self._post(job, index, continuation)
            pending.waiting -= 1
            if not pending.waiting:
                done.append(job)
        for (job, index), continuation in self.generation.continuations():
            self._post(job, index, continuation)
        now = time.monotonic()
        finished = [(job, self.pending.pop(job)) for job in done]
        return [(job, (p.texts, p.started, now - p.started)) for job, p in finished]

    @staticmethod
    def _post(job: Job, index: int, continuation: Any) -> None:
        """A streamed job's new text of prompt `index`, if any, to its client."""
        if job.payload.pieces is not None:
            text = continuation.take()
            if text:
                job.payload.post(index, text)
