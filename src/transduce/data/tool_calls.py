"""A reply's tool calls: the functions an instruct model asks its caller to run, read
out of the text it writes.

OpenAI-style clients give a model tools (JSON schemas of functions) and read its calls
apart from its answer, as `tool_calls` of {"name", "arguments": a JSON object's text}.
Open models write their calls in their text, each family in its own way, which its chat
template shows (it writes earlier calls back into the history the same way):

- Hermes' (Qwen2.5, Qwen3, QwQ, Hermes 2 Pro/3): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks, after the answer's text if any;
- Llama 3.1-3.3's: the whole reply one JSON object {"name": ..., "parameters": {...}}
  (or several, joined by ";"), `<|python_tag|>` first where the model writes it;
- Mistral's: `[TOOL_CALLS]` and then a JSON list of {"name", "arguments"} (v3 tokenizers),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (v11 on).

Each way can be forced (tool_choice "required" or a function): `forced` gives the
grammar its replies are generated within (decode/reply_grammar.py), Mistral's markers
read as the special tokens they are.

A reply whose calls do not parse (JSON cut off by max_tokens, a call without a name) is
all text, as the model wrote it, so that nothing it wrote is lost.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Callable

CallText = tuple[str, str]          # (function name, arguments: a JSON object's text)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str                  # a JSON object's text, as OpenAI's API carries it


@dataclass(frozen=True)
class CallFormat:
    """How one family of models writes its calls.

    split: (text, final) -> (its text apart from the calls, the calls); with final False
    the text is a streamed reply's so far, and what more text could turn into a call is
    held back (see ToolCallStream). id_prefix, id_length: a call's id, OpenAI's way
    ("call_" and 24 letters and digits) unless the family's templates want another
    (Mistral's refuse ids of other than 9 letters and digits)."""

    name: str
    split: Callable[[str, bool], tuple[str, list[CallText]]]
    # (functions, most calls) -> the reply grammar (decode/reply_grammar.py) of 1 to
    # `most` calls of them (None: no limit), for tool_choice "required" or a function
    forced: Callable[[list[dict], int | None], dict]
    id_prefix: str = "call_"
    id_length: int = 24

    def new_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        return self.id_prefix + "".join(secrets.choice(alphabet)
                                        for _ in range(self.id_length))


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text: an object (or one given as its text); None for
    anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(value: Any, argument_keys: tuple[str, ...]) -> CallText | None:
    """{"name": ..., <an argument key>: {...}} -> (name, arguments), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
            or not value["name"]:
        return None
    given = next((value[key] for key in argument_keys if key in value), {})
    arguments = _arguments(given)
    return None if arguments is None else (value["name"], arguments)


def _held_back(text: str, marker: str) -> str:
    """Text less its tail that may be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def _marked_split(text: str, final: bool, marker: str,
                  calls: Callable[[str], tuple[str, list[CallText]] | None]
                  ) -> tuple[str, list[CallText]]:
    """The split of formats whose calls follow a marker: the text before it, and what
    `calls` reads from the marker on (text it leaves around the calls, and the calls;
    None: they do not parse, all is text). Streamed, everything from the marker on waits
    for the end."""
    start = text.find(marker)
    if start < 0:
        return (text if final else _held_back(text, marker)).strip(), []
    if not final:
        return text[:start].strip(), []
    found = calls(text[start:])
    if found is None:
        return text.strip(), []
    return (text[:start] + found[0]).strip(), found[1]


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE)
                           + r"|\Z)", re.DOTALL)


def _hermes_calls(rest: str) -> tuple[str, list[CallText]] | None:
    """Blocks of one JSON call each, and the text between and after them (the last block
    may lack its close where the model ended the reply on it)."""
    calls, outside, position = [], [], 0
    for block in _HERMES_BLOCK.finditer(rest):
        outside.append(rest[position:block.start()])
        try:
            call = _call(json.loads(block.group(1)), ("arguments", "parameters"))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
        position = block.end()
    return "".join(outside) + rest[position:], calls


def _hermes_split(text: str, final: bool) -> tuple[str, list[CallText]]:
    return _marked_split(text, final, HERMES_OPEN, _hermes_calls)


def _json_values(text: str) -> list[Any] | None:
    """JSON values one after another, each followed by ";" or blank space; None if the
    text is not that."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        position = len(text) - len(text[position:].lstrip(" \t\n;"))
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        values.append(value)


PYTHON_TAG = "<|python_tag|>"


def _llama3_split(text: str, final: bool) -> tuple[str, list[CallText]]:
    """The whole reply as calls if it opens with "{" (or the python tag): Llama 3's JSON
    calls take the whole turn."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    elif PYTHON_TAG.startswith(body) and not final:
        return "", []                                    # the tag may still come
    if not final and (body == "" or body.startswith("{")):
        return "", []                                    # calls, or text, at the end
    if not body.startswith("{"):
        return text.strip(), []
    values = _json_values(body)
    calls = None if not values else [_call(value, ("parameters", "arguments"))
                                     for value in values]
    return (text.strip(), []) if calls is None or None in calls else ("", calls)


MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _mistral_calls(rest: str) -> tuple[str, list[CallText]] | None:
    """After [TOOL_CALLS]: a JSON list of calls, or name[ARGS]{...} per marker."""
    calls: list[CallText | None] = []
    for part in rest.split(MISTRAL_CALLS)[1:]:
        name, args, arguments = part.partition(MISTRAL_ARGS)
        values = _json_values(arguments if args else part)
        if not values or len(values) != 1:
            return None
        if args:
            calls.append(_call({"name": name.strip(), "arguments": values[0]}, ("arguments",)))
        elif isinstance(values[0], list):
            calls += [_call(value, ("arguments", "parameters")) for value in values[0]]
        else:
            return None
    return None if not calls or None in calls else ("", calls)


def _mistral_split(text: str, final: bool) -> tuple[str, list[CallText]]:
    return _marked_split(text, final, MISTRAL_CALLS, _mistral_calls)


def call_schema(functions: list[dict], arguments_key: str) -> dict:
    """One call of any of `functions` (OpenAI's {"name", "parameters"}) as a JSON Schema:
    {"name": its name, arguments_key: an instance of its parameters}, the name first as
    the templates write it. Each function's parameters sit under $defs, their own
    $refs pointing there."""
    definitions, calls = {}, []
    for index, function in enumerate(functions):
        where = f"#/$defs/f{index}"
        definitions[f"f{index}"] = _rebased(function.get("parameters") or {"type": "object"},
                                            where)
        calls.append({"type": "object", "required": ["name", arguments_key], "properties": {
            "name": {"const": function["name"]}, arguments_key: {"$ref": where}}})
    return {"$defs": definitions, "anyOf": calls}


def _rebased(schema: Any, base: str) -> Any:
    """A schema placed at `base` of another: its local $refs ("#/...") from there."""
    if isinstance(schema, dict):
        return {key: base + value[1:] if key == "$ref" and isinstance(value, str)
                and value.startswith("#") else _rebased(value, base)
                for key, value in schema.items()}
    return [_rebased(value, base) for value in schema] if isinstance(schema, list) else schema


def _hermes_forced(functions: list[dict], most: int | None) -> dict:
    """`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, a newline
    between two, as Qwen's templates write them."""
    block = {"sequence": [{"literal": HERMES_OPEN + "\n"},
                          {"json": call_schema(functions, "arguments"), "lenient": True},
                          {"literal": "\n" + HERMES_CLOSE}]}
    return {"repeat": block, "min": 1, "max": most, "separator": "\n"}


def _llama3_forced(functions: list[dict], most: int | None) -> dict:
    """{"name": ..., "parameters": {...}} objects, "; " between two."""
    return {"repeat": {"json": call_schema(functions, "parameters"), "lenient": True},
            "min": 1, "max": most, "separator": "; "}


def _mistral_forced(functions: list[dict], most: int | None) -> dict:
    """[TOOL_CALLS] (a special token) and a JSON list of calls, as v3 tokenizers'
    templates write them."""
    call = call_schema(functions, "arguments")
    calls = {"$defs": call.pop("$defs"), "type": "array", "items": call, "minItems": 1,
             **({"maxItems": most} if most is not None else {})}
    return {"sequence": [{"special": MISTRAL_CALLS}, {"json": calls, "lenient": True}]}


def _mistral_args_forced(functions: list[dict], most: int | None) -> dict:
    """[TOOL_CALLS]name[ARGS]{...} per call (special tokens both), as v11 tokenizers'
    templates write them: each name with its own function's arguments."""
    call = {"choice": [{"sequence": [
        {"special": MISTRAL_CALLS}, {"literal": function["name"]}, {"special": MISTRAL_ARGS},
        {"json": function.get("parameters") or {"type": "object"}, "lenient": True}]}
        for function in functions]}
    return {"repeat": call, "min": 1, "max": most}


HERMES = CallFormat("hermes", _hermes_split, _hermes_forced)
LLAMA3 = CallFormat("llama3_json", _llama3_split, _llama3_forced)
MISTRAL = CallFormat("mistral", _mistral_split, _mistral_forced, id_prefix="", id_length=9)
MISTRAL_WITH_ARGS = CallFormat("mistral", _mistral_split, _mistral_args_forced, id_prefix="",
                               id_length=9)


def call_format(template: str) -> CallFormat | None:
    """The way of writing calls that a chat template that takes tools writes earlier
    calls in; None where it takes none, or shows none of those this module reads."""
    if not takes_tools(template):
        return None
    if HERMES_OPEN in template:
        return HERMES
    if MISTRAL_CALLS in template:
        return MISTRAL_WITH_ARGS if MISTRAL_ARGS in template else MISTRAL
    if '"parameters": ' in template or PYTHON_TAG in template:
        return LLAMA3
    return None


def takes_tools(template: str) -> bool:
    """Whether a chat template reads the tools it is given at all."""
    return re.search(r"\btools\b", template) is not None


def split_tool_calls(text: str, form: CallFormat) -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (its text apart from the calls, None where there is none; the
    calls, each with an id of its own)."""
    content, calls = form.split(text, True)
    return content or None, [ToolCall(form.new_id(), *call) for call in calls]


class ToolCallStream:
    """split_tool_calls for a reply that comes a piece at a time: each feed gives the new
    text ("content", text); finish gives the rest of it and the calls ("tool_call",
    ToolCall). Joined, the texts are split_tool_calls' of the whole reply."""

    def __init__(self, form: CallFormat):
        self.form, self.text, self.sent = form, "", 0
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        self.text += piece
        return self._new(self.form.split(self.text, False)[0])

    def finish(self) -> list[tuple[str, Any]]:
        content, self.calls = split_tool_calls(self.text, self.form)
        return self._new(content or "") + [("tool_call", call) for call in self.calls]

    def _new(self, content: str) -> list[tuple[str, Any]]:
        if len(content) <= self.sent:
            return []
        new, self.sent = content[self.sent:], len(content)
        return [("content", new)]
