"""/v1/completions: prompts continued as they are, in the shape of OpenAI's (legacy)
completions API, for its clients and for evaluation harnesses, which score texts with
it: lm-evaluation-harness's local-completions sends a context and its continuation
with echo, max_tokens 1 and logprobs 1, sums the continuation's token_logprobs and
checks that each was the likeliest.

A prompt is a text (read as /v1/generate reads it: bos first where the model was
trained so) or token ids (read as they are). Each prompt gets n completions, each from
a seed of its own, generated in the continuous batches of /v1/generate; choice i * n +
j is prompt i's j-th. echo puts the prompt before its completion; max_tokens 0 with
echo generates nothing and scores the prompt alone.

logprobs: a second job on the decoding worker scores each prompt and its completion in
one causal pass (decode/token_logprobs.py), after the generation: the log-probability
of each token (the end token that stopped it included) from the model's own
distribution (before temperature, top-k or top-p), and the likeliest `logprobs` tokens
in its place, the token itself always among them. A prompt's first token has nothing
before it: null. A token's string is its piece of the text (decode/token_spans.py): the
pieces join to the choice's text. A stream gives each choice's logprobs in one chunk
after its pieces, scored once every choice is whole (OpenAI's clients join the chunks'
logprobs).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from transduce.decode.generate import Continuation, Generator, PromptError, PromptIds, \
    PromptTooLong, prompt_seeds
from transduce.decode.options import GenerateOptions
from transduce.serve.batcher import Job
from transduce.serve.completion_logprobs import Prompted, choice_logprobs
from transduce.serve.generation import EventFormat, Prompts, enqueue_prompts, events
from transduce.serve.limits import ApiError, check_texts
from transduce.serve.openai_shape import DONE, Completion, error_event, one_after_other, \
    sampling_options
from transduce.serve.schemas import CompletionChoice, CompletionRequest, CompletionResponse, \
    Timings
from transduce.serve.scoring import scored
from transduce.serve.service import Service
from transduce.serve.validation import OPENAI_ERROR_RESPONSES

SSE_DESCRIPTION = ("With \"stream\": true, text/event-stream: OpenAI's `data: {\"object\": "
                   "\"text_completion\", \"choices\": [{\"index\": i, \"text\": piece}]}` "
                   "events, then each choice's logprobs in one if asked, each choice's last "
                   "with its finish_reason (then one with the usage if "
                   "stream_options.include_usage), then `data: [DONE]`.")


@dataclass
class Generated:
    """One completion as the generation job answers it."""

    text: str
    tokens: list[int]          # generated, the end token that stopped it included
    context: list[int]         # the prompt's tokens its text is decoded after
    finish_reason: str

    @classmethod
    def nothing(cls) -> "Generated":
        """max_tokens 0: the prompt alone."""
        return cls("", [], [], "length")


class Completions(Prompts):
    """A completion job's payload: prompts as PromptIds of the ids the route read; results
    Generated."""

    @staticmethod
    def result(row: Continuation) -> Generated:
        ends = [] if row.end_token is None else [row.end_token]
        return Generated(row.text, row.tokens + ends, row.context, row.finish_reason)


def routes(service: Service) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", response_model=CompletionResponse, responses={
        **OPENAI_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}},
                                        "description": SSE_DESCRIPTION}},
        summary="Continue prompts, or score them (echo, logprobs): OpenAI's completions")
    async def complete(body: CompletionRequest):
        prompted = _prompts(service, body)
        options = _options(service, body)
        completion = Completion.new("cmpl", service.name, sum(len(p.ids) for p in prompted))
        each = [p for p in prompted for _ in range(body.n)]          # one per choice
        seeds = None if options.greedy else prompt_seeds(options.seed, len(each))
        tokens = sum(len(p.ids) + body.max_tokens for p in each)
        prompts = [PromptIds(p.ids) for p in each]            # read as the route read them
        if body.stream:
            pieces: asyncio.Queue = asyncio.Queue()
            job = enqueue_prompts(service, Completions(
                prompts, options, seeds, pieces, asyncio.get_running_loop()), tokens)
            return StreamingResponse(
                _chunks(service, job, pieces, completion, each, body),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        generated = [Generated.nothing() for _ in each]
        timings = Timings(queue_ms=0.0, decode_ms=0.0, total_ms=0.0)     # nothing run yet
        if body.max_tokens:
            job = enqueue_prompts(service, Completions(prompts, options, seeds), tokens)
            generated, timings = await service.wait(job)
        return await _answer(service, completion, each, generated, timings, body)

    return router


async def _answer(service: Service, completion: Completion, each: list[Prompted],
                  generated: list[Generated], timings: Timings,
                  body: CompletionRequest) -> CompletionResponse:
    """The whole answer: each choice's text (after its prompt with echo) and, if asked,
    its logprobs, scored now."""
    logprobs = [None] * len(each)
    if body.logprobs is not None:
        logprobs, scoring = await _scored(service, each, generated, body)
        timings = one_after_other(timings, scoring)
    return CompletionResponse(
        id=completion.id, created=completion.created, model=completion.model,
        choices=[CompletionChoice(index=i, text=(p.text if body.echo else "") + g.text,
                                  logprobs=lp, finish_reason=g.finish_reason)
                 for i, (p, g, lp) in enumerate(zip(each, generated, logprobs))],
        usage=completion.usage(sum(len(g.tokens) for g in generated)), timings=timings)


def _prompts(service: Service, body: CompletionRequest) -> list[Prompted]:
    """The request's prompts, each with its ids as the model reads them; too many (n
    completions of each), or one longer than the context, is 413, ids the model lacks
    422, naming the prompt."""
    generator: Generator = service.model
    given = body.prompt
    single = isinstance(given, str) or (given and isinstance(given[0], int))
    prompts = [given] if single else list(given)
    texts = [p for p in prompts if isinstance(p, str)]
    check_texts(texts, service.limits, "prompt", indexed=not single)
    if len(prompts) * body.n > service.limits.max_texts:
        raise ApiError(413, f"n: {len(prompts)} prompts x n {body.n} completions, more than "
                            f"the limit of {service.limits.max_texts} per request "
                            f"(max_texts)", "n")
    prompted = []
    for index, prompt in enumerate(prompts):
        field = "prompt" if single else f"prompt[{index}]"
        prompt = prompt if isinstance(prompt, str) else PromptIds(prompt)
        try:
            (ids,) = generator.encode([prompt])
        except PromptError as error:
            status = 413 if isinstance(error, PromptTooLong) else 422
            raise ApiError(status, str(error).replace("prompt 1", field), field) from None
        prompted.append(Prompted.of(generator.tokenizer, prompt, ids))
    return prompted


def _options(service: Service, body: CompletionRequest) -> GenerateOptions:
    """The request's settings as GenerateOptions; what OpenAI's API takes but this
    server does not do is refused naming the field."""
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(422, "max_tokens: 0 generates nothing; with echo it scores the "
                            "prompt alone", "max_tokens")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(422, f"best_of: {body.best_of} completions ranked for the best n "
                            f"are not drawn here: give n alone", "best_of")
    if body.stream and body.max_tokens == 0:
        raise ApiError(422, "max_tokens: 0 scores the prompt, which a stream does not "
                            "carry; ask without stream", "max_tokens")
    return sampling_options(body, max(1, body.max_tokens), service.limits.max_texts,
                            service.model)


async def _scored(service: Service, each: list[Prompted], generated: list[Generated],
                  body: CompletionRequest) -> tuple[list, Timings]:
    """Every choice's logprobs, scored by a job on the decoding worker, and its timings."""
    generator: Generator = service.model
    sequences = [p.ids + g.tokens for p, g in zip(each, generated)]
    scores, timings = await scored(service, sequences, body.logprobs)
    return [choice_logprobs(generator, p, g.tokens, g.text, g.context, s, body.echo)
            for p, g, s in zip(each, generated, scores)], timings


def _chunk(completion: Completion, index: int, text: str, finish_reason: str | None = None,
           logprobs: dict | None = None) -> str:
    """One "text_completion" event: choice `index`'s next piece (and its logprobs)."""
    return completion.event("text_completion", [{"index": index, "text": text,
                                                 "logprobs": logprobs,
                                                 "finish_reason": finish_reason}])


async def _chunks(service: Service, job: Job, pieces: asyncio.Queue, completion: Completion,
                  each: list[Prompted], body: CompletionRequest) -> AsyncIterator[str]:
    """OpenAI's stream: each choice's prompt if echo, the pieces as they come, each
    choice's logprobs if asked, its finish reason, the usage if asked, [DONE]; an error
    ends it as an {"error": ...} event."""
    async def done(results: list[Generated], timings: Timings) -> str:
        last = ""
        if body.logprobs is not None:
            logprobs, _ = await _scored(service, each, results, body)
            last += "".join(_chunk(completion, i, "", logprobs=lp.model_dump())
                            for i, lp in enumerate(logprobs))
        last += "".join(_chunk(completion, i, "", g.finish_reason)
                        for i, g in enumerate(results))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = completion.usage(sum(len(g.tokens) for g in results))
            last += completion.event("text_completion", [], usage=usage.model_dump())
        return last + DONE

    if body.echo:
        for index, prompt in enumerate(each):
            yield _chunk(completion, index, prompt.text)
    form = EventFormat(piece=lambda index, text: _chunk(completion, index, text), done=done,
                       error=error_event)
    async for event in events(service, job, pieces, form):
        yield event
