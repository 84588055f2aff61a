"""A chat reply's parts, as OpenAI's chat API gives them: a thinking model's reasoning
(data/reasoning.py), the answer's text, and, where the request gave tools, the calls
the reply makes (data/tool_calls.py), whole or as a stream's deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from transduce.data.reasoning import ReasoningStream, split_reasoning
from transduce.data.tool_calls import CallFormat, ToolCall, ToolCallStream, split_tool_calls
from transduce.serve.schemas import AssistantMessage, ReplyFunction, ReplyToolCall


@dataclass(frozen=True)
class ReplyParts:
    """How a request's replies come apart. thinks: the model reasons first (inside: its
    prompt opened the reasoning); calls: how the model writes tool calls, None where the
    request gave no tools; parallel: every call the reply makes, else its first."""

    thinks: bool = False
    inside: bool = False
    calls: CallFormat | None = None
    parallel: bool = True

    def message(self, text: str) -> AssistantMessage:
        """A whole reply's message."""
        reasoning, content = split_reasoning(text, self.inside) if self.thinks \
            else (None, text)
        calls: list[ToolCall] = []
        if self.calls is not None:
            answer, calls = split_tool_calls(content, self.calls)
            content = answer if calls else answer or ""
        return AssistantMessage(content=content, reasoning_content=reasoning,
                                tool_calls=[_reply_call(call) for call in self._kept(calls)])

    def stream(self) -> ReplyStream:
        return ReplyStream(self)

    def _kept(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]


def finish_reason(calls: Sequence, finish: str) -> str:
    """OpenAI's "tool_calls" for a reply that ended (finish "stop") calling tools."""
    return "tool_calls" if calls and finish == "stop" else finish


def _reply_call(call: ToolCall) -> ReplyToolCall:
    return ReplyToolCall(id=call.id, function=ReplyFunction(name=call.name,
                                                            arguments=call.arguments))


class ReplyStream:
    """ReplyParts.message for a reply that comes a piece at a time: each feed, and the
    finish, give deltas of a "chat.completion.chunk" ({"reasoning_content": ...},
    {"content": ...}, {"tool_calls": [one call, whole]}), which joined are the message's
    parts. A call comes whole once the reply is: a call's text is only known to be one
    when it parses."""

    def __init__(self, parts: ReplyParts):
        self.parts = parts
        self.reasoning = ReasoningStream(parts.inside) if parts.thinks else None
        self.calls = None if parts.calls is None else ToolCallStream(parts.calls)
        self.called: list[ToolCall] = []

    def feed(self, piece: str) -> list[dict[str, Any]]:
        texts = [("content", piece)] if self.reasoning is None else self.reasoning.feed(piece)
        return self._deltas(texts)

    def finish(self) -> list[dict[str, Any]]:
        deltas = self._deltas([] if self.reasoning is None else self.reasoning.finish())
        return deltas + ([] if self.calls is None else self._answer(self.calls.finish()))

    def finish_reason(self, finish: str) -> str:
        return finish_reason(self.called, finish)

    def _deltas(self, texts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for field, text in texts:
            if field == "content" and self.calls is not None:
                deltas += self._answer(self.calls.feed(text))
            else:
                deltas.append({field: text})
        return deltas

    def _answer(self, parts: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for field, value in parts:
            if field == "content":
                deltas.append({"content": value})
            elif self.parts.parallel or not self.called:
                call = _reply_call(value).model_dump()
                deltas.append({"tool_calls": [{"index": len(self.called), **call}]})
                self.called.append(value)
        return deltas
