"""The route of a decoder-only model: /v1/generate, whole or streamed (server-sent events).

Requests share batches, each prompt getting what it gets alone; sampled ones too, as
each prompt draws from its own seed (prompt_seeds of the request's seed and its place in
the request). Greedy and sampled requests of any settings, whole or streamed, are batched
continuously (serve/continuous.py's GenerationStream): prompts join the running batch
between steps, each with its request's settings, and leave it, answered, when done. Beam
search or --static-batches run whole batches of requests with the same settings, with
Generator.generate or, streamed, Generator.stream_batch. A streamed request gets each
step's new text as it is made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from transduce.config import ConfigError
from transduce.decode.generate import Continuation, Generator, Prompt, prompt_seeds, with_bos
from transduce.decode.options import GenerateOptions
from transduce.serve.batcher import Job
from transduce.serve.continuous import generation_stream
from transduce.serve.limits import ApiError, check_texts
from transduce.serve.schemas import GenerateRequest, GenerateResponse, Timings
from transduce.serve.service import Service, split_by_job, timed
from transduce.serve.validation import ERROR_RESPONSES

SSE_DESCRIPTION = ("With \"stream\": true, text/event-stream: `data: {\"index\": i, \"text\": "
                   "piece}` events in order, then `event: done` with the timings (or `event: "
                   "error`).")


def routes(service: Service) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/generate", response_model=GenerateResponse, responses={
        **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}},
                                 "description": SSE_DESCRIPTION}},
        summary="Continue prompts with a language model, whole or streamed")
    async def generate(body: GenerateRequest):
        options, lengths = _check(service, body)
        tokens = sum(n + options.max_new_tokens for n in lengths)
        seeds = None if options.greedy else prompt_seeds(options.seed, len(body.prompts))
        if not body.stream:
            job = enqueue_prompts(service, Prompts(body.prompts, options, seeds), tokens)
            texts, timings = await service.wait(job)
            return GenerateResponse(generations=texts, timings=timings)
        pieces: asyncio.Queue = asyncio.Queue()
        job = enqueue_prompts(service, Prompts(body.prompts, options, seeds, pieces,
                                               asyncio.get_running_loop()), tokens)
        return StreamingResponse(events(service, job, pieces), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return router


def enqueue_prompts(service: Service, payload: Prompts, tokens: int) -> Job:
    """Queue a job of prompts: generated continuously where its settings allow, else in
    whole batches of the same settings; streamed where its payload has a queue for the
    pieces. One stream runs every continuous job; whole batches share settings, save the
    seed (each prompt has its own)."""
    generator, options = service.model, payload.options
    stream = generation_stream(generator, options)
    streamed = payload.pieces is not None
    key = ("generate",) if stream is not None and service.batcher.streams else \
        ("generate", streamed, dataclasses.replace(options, seed=None))
    runner = run_streamed if streamed else run_whole
    run = timed(lambda jobs: runner(generator, options, jobs))
    return service.enqueue(key, run, payload, tokens, len(payload), stream)


def _check(service: Service, body: GenerateRequest) -> tuple[GenerateOptions, list[int]]:
    """The request's options and each prompt's length in tokens; refuses what the model
    cannot take, naming the field."""
    generator: Generator = service.model
    check_texts(body.prompts, service.limits, "prompts")
    fields = body.model_dump(exclude={"prompts", "stream"})
    fields["stop"] = tuple(fields["stop"])
    try:
        options = GenerateOptions(**fields, batch_sentences=service.limits.max_texts)
        generator.check_vocabulary(options)
    except ConfigError as error:
        raise named(error) from None
    if body.stream and options.beam > 1:
        raise ApiError(422, "stream: beam search knows its best continuation only at the "
                            "end; stream with beam 1", "stream")
    lengths = []
    for index, ids in enumerate(generator.tokenizer.encode(body.prompts)):
        length = len(with_bos(ids, generator.tokenizer))
        if length >= generator.context:
            raise ApiError(413, f"prompts[{index}]: {length} tokens, but the model reads "
                                f"{generator.context} positions in all (prompt and "
                                f"continuation)", f"prompts[{index}]")
        lengths.append(length)
    return options, lengths


def named(error: ConfigError) -> ApiError:
    """GenerateOptions' refusal ("GenerateOptions.beam=2: ...") as the request's field."""
    found = re.match(r"GenerateOptions\.(\w+)(=|\[|: |\.)", str(error))
    if found is None:
        return ApiError(422, str(error))
    field = found.group(1)
    if found.group(2) == ".":                      # a place within it (a json_schema's)
        return ApiError(422, str(error).removeprefix("GenerateOptions."), field)
    return ApiError(422, f"{field}: {str(error).split(': ', 1)[-1]}", field)


@dataclass
class Prompts:
    """A generate job's payload: its prompts (texts, Chats: serve/chat.py, or PromptIds:
    serve/completions.py), their settings and seeds (None: greedy or beam) and, when
    streamed, the queue its pieces go to, on the event loop's thread."""

    texts: list[Prompt]
    options: GenerateOptions
    seeds: list[int] | None
    pieces: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self.texts)

    @staticmethod
    def result(row: Continuation) -> Any:
        """What the job answers of one finished continuation: its text."""
        return row.text

    def post(self, index: int, text: str) -> None:
        """From the decoding thread: prompt `index`'s new text, to its stream."""
        self.loop.call_soon_threadsafe(self.pieces.put_nowait, (index, text))


def _joined(jobs: Sequence[Job]) -> tuple[list[str], list[int] | None]:
    """Every job's prompts, and their seeds, in order."""
    prompts = [text for job in jobs for text in job.payload.texts]
    if jobs[0].payload.seeds is None:
        return prompts, None
    return prompts, [seed for job in jobs for seed in job.payload.seeds]


def run_whole(generator: Generator, options: GenerateOptions,
              jobs: Sequence[Job]) -> list[list[Any]]:
    """On the worker: every job's prompts generated together, each with its own seed ->
    per job, its results (payload.result of each continuation)."""
    prompts, seeds = _joined(jobs)
    rows = split_by_job(jobs, generator.generate_rows(prompts, options, seeds=seeds))
    return [[job.payload.result(row) for row in own] for job, own in zip(jobs, rows)]


def run_streamed(generator: Generator, options: GenerateOptions,
                 jobs: Sequence[Job]) -> list[list[Any]]:
    """On the worker: every job's prompts generated together; each step's new text goes
    to its job's stream (index within the job, text) -> per job, its results."""
    prompts, seeds = _joined(jobs)
    owners = [(job.payload, i) for job in jobs for i in range(len(job.payload))]
    rows: list[Continuation] = []
    for rows in generator.stream_rows(prompts, options, seeds=seeds):
        for (payload, index), row in zip(owners, rows):
            text = row.take()
            if text:
                payload.post(index, text)
    return [[job.payload.result(row) for row in own]
            for job, own in zip(jobs, split_by_job(jobs, rows))]


@dataclass(frozen=True)
class EventFormat:
    """How a streamed job's server-sent events read: a piece of prompt `index`'s text,
    the end (the job's results and timings; a coroutine where the end waits for more
    work, scoring what was generated), an error (ApiError's body)."""

    piece: Callable[[int, str], str]
    done: Callable[[Any, Timings], str | Awaitable[str]]
    error: Callable[[dict], str]


GENERATE_EVENTS = EventFormat(
    piece=lambda index, text: f"data: {json.dumps({'index': index, 'text': text})}\n\n",
    done=lambda results, timings: f"event: done\ndata: {timings.model_dump_json()}\n\n",
    error=lambda body: f"event: error\ndata: {json.dumps(body)}\n\n")


async def events(service: Service, job: Job, pieces: asyncio.Queue,
                 form: EventFormat = GENERATE_EVENTS) -> AsyncIterator[str]:
    """The SSE stream of one job: its pieces as they come, then done (or error). A client
    that leaves cancels its job if the worker has not started it."""
    waiting = asyncio.ensure_future(service.wait(job))
    getter = None
    try:
        while True:
            getter = asyncio.ensure_future(pieces.get())
            await asyncio.wait({getter, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                break
            yield form.piece(*getter.result())
        while not pieces.empty():                  # what the last step put
            yield form.piece(*pieces.get_nowait())
        try:
            results, timings = waiting.result()
            ending = form.done(results, timings)
            yield await ending if inspect.isawaitable(ending) else ending
        except ApiError as error:
            yield form.error(error.body())
        except Exception as error:          # noqa: BLE001 - the status line is already sent
            yield form.error({"error": f"generation failed: {error}"})
    finally:
        for task in (getter, waiting):
            if task is not None and not task.done():
                task.cancel()

