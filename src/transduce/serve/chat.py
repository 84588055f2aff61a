"""/v1/chat/completions: an instruct model's reply to a conversation, in the shape of
OpenAI's chat completions API, so that its clients (the `openai` package, LangChain,
curl scripts written for it) talk to a model served here by changing the base URL.

The conversation is laid out by the model's chat template (data/chat.py) and generated
as a prompt of /v1/generate's, in the same continuous batches. A reply is one choice
(or n, each sampled from a seed of its own, as /v1/completions draws its n), whole or
streamed as "chat.completion.chunk" events ending in `data: [DONE]`; usage counts the
prompt's tokens once and the replies' (each end token included), and
finish_reason says "stop" (an end token or a stop string) or "length" (max_tokens, or
the end of the model's context). A thinking model's reasoning (Qwen3's <think> ...
</think>) comes apart from its answer, as `reasoning_content` (data/reasoning.py), and
an earlier reply's reasoning may come back in the history as that field. Given `tools`,
the model's template shows them to it, and the calls its reply makes come apart as
`tool_calls` (data/tool_calls.py: Hermes', Llama 3's and Mistral's ways of writing them),
with finish_reason "tool_calls"; the calls and the tools' results come back in the
history as OpenAI's assistant and "tool" messages. tool_choice "required" or a named
function forces calls: the reply is generated within the grammar of the template's
calls (data/tool_calls.py's forced forms, decode/constrained.py), as response_format
keeps it to JSON; a thinking model reasons first, and what follows its reasoning is
kept so.
The defaults are OpenAI's: temperature 1, and a reply as long as the context allows. OpenAI's
frequency and presence penalties and logit bias are taken (decode/penalties.py), and
repetition_penalty, top_k and min_p, as /v1/generate's, are ours, as is
chat_template_kwargs (vLLM's: the template's variables); any other field OpenAI's API
lacks is refused.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from transduce.config import ConfigError
from transduce.data.chat import Chat, ChatError, template_variables
from transduce.data.reasoning import reasoning_first, reasoning_markers
from transduce.data.tool_calls import CallFormat, call_format, takes_tools
from transduce.decode.generate import Continuation, Generator, PromptError, prompt_seeds
from transduce.decode.json_schema import SchemaError, schema_node
from transduce.decode.options import GenerateOptions
from transduce.serve.generation import EventFormat, Prompts, enqueue_prompts, events
from transduce.serve.limits import ApiError, check_texts
from transduce.serve.completion_logprobs import reply_logprobs
from transduce.serve.openai_shape import DONE, Completion, error_event, one_after_other, \
    sampling_options
from transduce.serve.chat_reply import ReplyParts, ReplyStream, finish_reason
from transduce.serve.schemas import ChatChoice, ChatLogprobs, ChatRequest, ChatResponse, \
    NamedToolChoice, Timings
from transduce.serve.scoring import scored
from transduce.serve.service import Service
from transduce.serve.validation import OPENAI_ERROR_RESPONSES

SSE_DESCRIPTION = ("With \"stream\": true, text/event-stream: OpenAI's `data: "
                   "{\"object\": \"chat.completion.chunk\", ...}` events, the reply's "
                   "logprobs in one after its pieces if asked, the last with its "
                   "finish_reason (then one with the usage if stream_options.include_usage), "
                   "then `data: [DONE]`.")


@dataclass
class Reply:
    text: str
    ids: list[int]            # the content's tokens (not the end token)
    tokens: int               # generated, the end token included
    finish_reason: str


class Conversations(Prompts):
    """A chat job's payload: one Chat; its result is the Reply."""

    @staticmethod
    def result(row: Continuation) -> Reply:
        return Reply(row.text, list(row.tokens), len(row.tokens) + (row.end_token is not None),
                     row.finish_reason)


def _chunk(completion: Completion, delta: dict | None, finish_reason: str | None = None,
           logprobs: dict | None = None, index: int = 0, **more: Any) -> str:
    """One "chat.completion.chunk" event: reply `index`'s delta (None: no choice), and
    the logprobs of its tokens."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]
    return completion.event("chat.completion.chunk", choices, **more)


def routes(service: Service) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=ChatResponse, responses={
        **OPENAI_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}},
                                        "description": SSE_DESCRIPTION}},
        summary="An instruct model's reply to a conversation (OpenAI's chat completions)")
    async def chat(body: ChatRequest):
        calls = _call_format(service, body)
        conversation, prompt = _conversation(service, body, with_tools=calls is not None)
        options = _options(service, body, len(prompt), calls)
        markers = reasoning_markers(service.model.tokenizer)
        inside = markers is not None and markers.starts_inside(prompt)
        options = reasoning_first(options, markers, inside)   # the grammar after reasoning
        parts = ReplyParts(thinks=markers is not None, inside=inside, calls=calls,
                           parallel=body.parallel_tool_calls)
        seeds = None if options.greedy else prompt_seeds(options.seed, body.n)
        completion = Completion.new("chatcmpl", service.name, len(prompt))
        tokens = (len(prompt) + options.max_new_tokens) * body.n
        each = [conversation] * body.n                                # one per choice
        if not body.stream:
            job = enqueue_prompts(service, Conversations(each, options, seeds), tokens)
            replies, timings = await service.wait(job)
            return await _answer(service, body, completion, prompt, replies, timings, parts)
        pieces: asyncio.Queue = asyncio.Queue()
        job = enqueue_prompts(service, Conversations(each, options, seeds, pieces,
                                                     asyncio.get_running_loop()), tokens)
        streams = [parts.stream() for _ in range(body.n)]
        return StreamingResponse(_chunks(service, job, pieces, completion, prompt, body,
                                         streams),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return router


async def _answer(service: Service, body: ChatRequest, completion: Completion,
                  prompt: list[int], replies: list[Reply], timings: Timings,
                  parts: ReplyParts) -> ChatResponse:
    """The whole answer: the replies (their parts apart) and, if asked, their tokens'
    logprobs, scored now."""
    logprobs: list[ChatLogprobs | None] = [None] * len(replies)
    if body.logprobs:
        logprobs, scoring = await _scored(service, body, prompt, replies)
        timings = one_after_other(timings, scoring)
    messages = [parts.message(reply.text) for reply in replies]
    return ChatResponse(
        id=completion.id, created=completion.created, model=completion.model,
        choices=[ChatChoice(index=index, message=message, logprobs=scores,
                            finish_reason=finish_reason(message.tool_calls,
                                                        reply.finish_reason))
                 for index, (reply, message, scores)
                 in enumerate(zip(replies, messages, logprobs))],
        usage=completion.usage(sum(reply.tokens for reply in replies)), timings=timings)


async def _scored(service: Service, body: ChatRequest, prompt: list[int],
                  replies: list[Reply]) -> tuple[list[ChatLogprobs], Timings]:
    """The replies' tokens' logprobs, scored by one job on the decoding worker, and its
    timings."""
    top = body.top_logprobs or 0
    scores, timings = await scored(service, [prompt + reply.ids for reply in replies], top)
    return [reply_logprobs(service.model, prompt, reply.ids, reply.text, each, top)
            for reply, each in zip(replies, scores)], timings


def _conversation(service: Service, body: ChatRequest,
                  with_tools: bool) -> tuple[Chat, list[int]]:
    """The request's conversation (with its tools, with_tools) and its ids as the
    template lays it out; a model without a template, or a conversation its template
    refuses, is 422, one longer than the model's context 413."""
    generator: Generator = service.model
    check_texts([(m.content or "") + (m.reasoning_content or "")
                 + "".join(call.function.arguments for call in m.tool_calls or ())
                 for m in body.messages], service.limits, "messages")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    check_texts([json.dumps(tool) for tool in tools], service.limits, "tools")
    template = getattr(generator.tokenizer, "chat_template", None)
    try:
        variables = template_variables(body.chat_template_kwargs or {},
                                       tokens=template.tokens if template else ())
    except ChatError as error:
        raise ApiError(422, str(error), "chat_template_kwargs") from None
    try:
        conversation = Chat.of([m.model_dump(exclude_none=True) for m in body.messages],
                               variables=variables, tools=tools if with_tools else ())
    except ChatError as error:                 # it names the message's field first
        raise ApiError(422, str(error), str(error).partition(":")[0]) from None
    try:
        (ids,) = generator.encode([conversation])
    except (ConfigError, ChatError) as error:
        raise ApiError(422, str(error), "messages") from None
    except PromptError as error:
        raise ApiError(413, str(error).replace("prompt 1", "messages"), "messages") from None
    return conversation, ids


def _call_format(service: Service, body: ChatRequest) -> CallFormat | None:
    """How the model writes the calls the request lets it make: None without tools (or
    with tool_choice "none"); tools for a template that takes none, or writes calls in
    no way data/tool_calls.py reads, are 422."""
    choice = body.tool_choice
    if body.tools is None:
        if choice is not None:
            raise ApiError(422, "tool_choice: give it with tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            tool.function.name for tool in body.tools}:
        raise ApiError(422, f"tool_choice.function.name: {choice.function.name!r} is not "
                            f"among the tools", "tool_choice.function.name")
    template = getattr(service.model.tokenizer, "chat_template", None)
    if template is None:
        return None                    # encoding the conversation says there is none
    if not takes_tools(template.template):
        raise ApiError(422, "tools: the model's chat template takes no tools", "tools")
    form = call_format(template.template)
    if form is None:
        raise ApiError(422, "tools: the model's chat template takes tools but writes calls "
                            "in none of the ways this server reads (Hermes' <tool_call> "
                            "blocks: Qwen2.5, Qwen3, Hermes; Llama 3.1's JSON; Mistral's "
                            "[TOOL_CALLS])", "tools")
    return form


def _forced_calls(body: ChatRequest, form: CallFormat | None) -> dict | None:
    """The reply grammar of the calls tool_choice forces (None: it forces none): one call
    of the named function, or one or more of any (one without parallel_tool_calls).
    A tool's parameters that are no schema are 422 naming them; assertions the grammar
    cannot keep (pattern, bounds) are read past."""
    choice = body.tool_choice
    if form is None or choice in (None, "auto"):
        return None
    functions = []
    for index, tool in enumerate(body.tools):
        function = tool.function.model_dump(exclude_none=True)
        if isinstance(choice, NamedToolChoice) and function["name"] != choice.function.name:
            continue
        where = f"tools[{index}].function.parameters"
        try:
            schema_node(function.get("parameters") or {"type": "object"}, where, lenient=True)
        except SchemaError as error:
            raise ApiError(422, str(error), where) from None
        functions.append(function)
    named = isinstance(choice, NamedToolChoice)
    return form.forced(functions, 1 if named or not body.parallel_tool_calls else None)


def _options(service: Service, body: ChatRequest, prompt_tokens: int,
             calls: CallFormat | None) -> GenerateOptions:
    """The request's settings as GenerateOptions: max_tokens (or max_completion_tokens;
    default: what the context leaves), one reply, no beam, the calls forced if asked."""
    generator: Generator = service.model
    forced = _forced_calls(body, calls)
    if forced is not None and body.reply_schema() is not None:
        raise ApiError(422, "response_format: a forced tool call is the reply's form; give "
                            "response_format or tool_choice \"required\" (or a function)",
                       "response_format")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError(422, "max_tokens and max_completion_tokens differ: give one",
                       "max_completion_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(422, "top_logprobs: give it with logprobs true", "top_logprobs")
    if body.n > service.limits.max_texts:
        raise ApiError(413, f"n: {body.n} replies, more than the limit of "
                            f"{service.limits.max_texts} per request (max_texts)", "n")
    most = body.max_tokens or body.max_completion_tokens \
        or generator.context - prompt_tokens
    return sampling_options(body, most, service.limits.max_texts, generator, forced)


async def _chunks(service: Service, job, pieces: asyncio.Queue, completion: Completion,
                  prompt: list[int], body: ChatRequest,
                  streams: list[ReplyStream]) -> AsyncIterator[str]:
    """OpenAI's stream: each reply's role, its pieces (chunks of each choice's index as
    they come, in the parts its stream in `streams` gives: reasoning_content, content,
    tool_calls), with logprobs each reply's in one chunk (scored once they are whole:
    OpenAI's clients join every chunk's logprobs.content), the finish reasons, the usage
    if asked, [DONE]; an error ends it as an {"error": ...} event."""
    def piece(index: int, text: str) -> str:
        return "".join(_chunk(completion, delta, index=index)
                       for delta in streams[index].feed(text))

    async def done(replies: list[Reply], timings: Timings) -> str:
        last = "".join(_chunk(completion, delta, index=index)
                       for index, stream in enumerate(streams) for delta in stream.finish())
        if body.logprobs:
            logprobs, _ = await _scored(service, body, prompt, replies)
            last += "".join(_chunk(completion, {}, logprobs=each.model_dump(), index=index)
                            for index, each in enumerate(logprobs))
        last += "".join(_chunk(completion, {}, stream.finish_reason(reply.finish_reason),
                               index=index)
                        for index, (reply, stream) in enumerate(zip(replies, streams)))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = completion.usage(sum(reply.tokens for reply in replies))
            last += _chunk(completion, None, usage=usage.model_dump())
        return last + DONE

    form = EventFormat(piece=piece, done=done, error=error_event)
    for index in range(body.n):
        yield _chunk(completion, {"role": "assistant", "content": ""}, index=index)
    async for event in events(service, job, pieces, form):
        yield event
