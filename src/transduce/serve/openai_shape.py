"""What the routes in OpenAI's shape share (chat.py, completions.py): a completion's
id and time, its usage, its server-sent events, an error event and the stream's end,
and the sampling settings of a request."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from transduce.config import ConfigError
from transduce.decode.generate import Generator
from transduce.decode.json_schema import SchemaError
from transduce.decode.options import GenerateOptions
from transduce.serve.generation import named
from transduce.serve.limits import ApiError
from transduce.serve.schemas import OpenAISampling, Timings, Usage

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Completion:
    """What every chunk or answer of one request repeats."""

    id: str
    created: int
    model: str
    prompt_tokens: int

    @classmethod
    def new(cls, prefix: str, model: str, prompt_tokens: int) -> "Completion":
        """A new one, its id OpenAI's prefix ("cmpl", "chatcmpl") and 24 hex digits."""
        return cls(f"{prefix}-{secrets.token_hex(12)}", int(time.time()), model,
                   prompt_tokens)

    def usage(self, completion_tokens: int) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=self.prompt_tokens + completion_tokens)

    def event(self, kind: str, choices: list[dict], **more: Any) -> str:
        """One server-sent event: an object of `kind` with these choices."""
        return "data: " + json.dumps({"id": self.id, "object": kind, "created": self.created,
                                      "model": self.model, "choices": choices,
                                      **more}) + "\n\n"


def sampling_options(body: OpenAISampling, max_new_tokens: int, batch_sentences: int,
                     generator: Generator, grammar: dict | None = None) -> GenerateOptions:
    """A request's sampling as GenerateOptions for `generator`, its response_format's
    schema, or `grammar` (a forced tool call's); what they refuse is a 422 naming the
    field."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    schema = body.reply_schema()
    try:
        options = GenerateOptions(
            max_new_tokens=max_new_tokens, temperature=body.temperature, top_k=body.top_k,
            top_p=body.top_p, min_p=body.min_p, seed=body.seed,
            repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
            logit_bias=body.logit_bias, stop=stop, batch_sentences=batch_sentences,
            json_schema=schema, grammar=grammar)
        generator.check_vocabulary(options)
        return options
    except ConfigError as error:
        if schema is not None and str(error).startswith("GenerateOptions.json_schema"):
            # a place in the schema (SchemaError), or the vocabulary's refusal of it
            place = "response_format.json_schema.schema" if isinstance(error, SchemaError) \
                else "response_format"
            raise ApiError(422, str(error).replace("GenerateOptions.json_schema", place, 1),
                           "response_format") from None
        raise named(error) from None


def one_after_other(first: Timings, second: Timings) -> Timings:
    """The timings of a request that ran two jobs, one after the other (a generation,
    then its scoring)."""
    return Timings(queue_ms=round(first.queue_ms + second.queue_ms, 3),
                   decode_ms=round(first.decode_ms + second.decode_ms, 3),
                   total_ms=round(first.total_ms + second.total_ms, 3))


def error_event(body: dict) -> str:
    """A stream's error (ApiError.body's shape) as OpenAI's error body, then the end."""
    error = ApiError(422, body["error"], body.get("field")).openai_body()
    return f"data: {json.dumps(error)}\n\n{DONE}"
