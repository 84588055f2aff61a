"""A thinking model's reply in two parts: the reasoning it writes between <think> and
</think> (Qwen3's, QwQ's, DeepSeek-R1's distillations'), and the answer after it.

OpenAI-style clients read the two apart: the answer as the message's `content`, the
reasoning as `reasoning_content` (DeepSeek's API field, which vLLM and chat front ends
read too). The split follows what the models' own templates do when a reply comes back
as history: the reasoning without the newlines around it, the answer without the
newlines that open it (Qwen3's `content.split('</think>')[-1].lstrip('\\n')`).

A reasoning block counts only at the reply's start (after blank space): a "<think>"
later in an answer is the answer's text. A template may open the block itself
(DeepSeek-R1's and QwQ's end the prompt with "<think>\\n"): the reply then starts inside
it, and its "</think>" is the first marker it writes. A reply cut off while reasoning is
all reasoning, with no answer. A reply kept to JSON (or to forced calls) may reason
first: the grammar lets the reasoning be and keeps what follows it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

OPEN, CLOSE = "<think>", "</think>"
BLANK_AFTER = 8       # the spaces and newlines a reply may put between reasoning and JSON


@dataclass(frozen=True)
class ReasoningMarkers:
    """The two markers' token ids in a model's vocabulary."""

    open_id: int
    close_id: int

    def starts_inside(self, prompt: Sequence[int]) -> bool:
        """Whether the prompt leaves the model inside a reasoning block: its last marker
        is an opening one."""
        for token in reversed(prompt):
            if token in (self.open_id, self.close_id):
                return token == self.open_id
        return False


def reasoning_markers(tokenizer) -> ReasoningMarkers | None:
    """The markers of a thinking model: tokens of their own in its vocabulary, which its
    chat template writes; None for any other model (its replies are all answer)."""
    template = getattr(tokenizer, "chat_template", None)
    backend = getattr(tokenizer, "backend", None)
    if template is None or backend is None or CLOSE not in template.template:
        return None
    ids = backend.token_to_id(OPEN), backend.token_to_id(CLOSE)
    return None if None in ids else ReasoningMarkers(*ids)


def reasoning_grammar(reply: str, inside: bool) -> str:
    """A reply grammar (decode/reply_grammar.py's JSON text: JSON, forced calls) with the
    reasoning a thinking model writes before it: where the prompt opened the block, any
    text up to </think> first; else a block of its own, <think> ... </think>, or none.
    So the model reasons freely, and then what follows is kept to `reply`."""
    kept = json.loads(reply)
    reasoned = {"sequence": [{"text_until": CLOSE}, {"blank": BLANK_AFTER}, kept]}
    if not inside:
        reasoned = {"choice": [{"sequence": [{"marker": OPEN}, reasoned]}, kept]}
    return json.dumps(reasoned)


def reasoning_first(options, markers: ReasoningMarkers | None, inside: bool):
    """GenerateOptions whose reply grammar (a json_schema's or a grammar's) a thinking
    model (markers given) reaches after its reasoning (reasoning_grammar); others' as
    they are. inside: the prompt opened the reasoning block."""
    if markers is None or options.reply_grammar is None:
        return options
    return options.replace(json_schema=None,
                           grammar=reasoning_grammar(options.reply_grammar, inside))


def split_reasoning(text: str, inside: bool = False,
                    final: bool = True) -> tuple[str | None, str]:
    """A reply's text -> (its reasoning, None where it has no reasoning block; its
    answer). inside: the prompt opened the block. final False: the text is a streamed
    reply's so far, and what more text could still change (a marker's first characters,
    newlines that may end the reasoning, blank space that may precede "<think>") is held
    back, so that each part only grows as the text does."""
    body = text
    if not inside:
        opening = text.lstrip()
        if not opening.startswith(OPEN):
            if not final and OPEN.startswith(opening):
                return None, ""                  # the block may still open
            return None, text
        body = opening[len(OPEN):]
    end = body.find(CLOSE)
    if end >= 0:
        return body[:end].strip("\n"), body[end + len(CLOSE):].lstrip("\n")
    if final:
        return body.strip("\n"), ""
    return _held_back(body).strip("\n"), ""


def _held_back(body: str) -> str:
    """Reasoning so far less its tail that may be the start of CLOSE."""
    for size in range(min(len(CLOSE) - 1, len(body)), 0, -1):
        if CLOSE.startswith(body[-size:]):
            return body[:-size]
    return body


class ReasoningStream:
    """split_reasoning for a reply that comes a piece at a time: each feed gives the new
    text of each part, ("reasoning_content" | "content", text) in order; finish gives
    what was held back. Joined, the parts are split_reasoning's of the whole text."""

    def __init__(self, inside: bool = False):
        self.inside, self.text = inside, ""
        self.sent = {"reasoning_content": 0, "content": 0}

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.text += piece
        return self._new(*split_reasoning(self.text, self.inside, final=False))

    def finish(self) -> list[tuple[str, str]]:
        return self._new(*split_reasoning(self.text, self.inside))

    def _new(self, reasoning: str | None, content: str) -> list[tuple[str, str]]:
        deltas = []
        for field, part in (("reasoning_content", reasoning or ""), ("content", content)):
            if len(part) > self.sent[field]:
                deltas.append((field, part[self.sent[field]:]))
                self.sent[field] = len(part)
        return deltas
