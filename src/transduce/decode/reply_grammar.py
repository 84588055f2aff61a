"""What a whole reply must be, as a small grammar of JSON and text around it: a JSON
Schema's instance, a literal text, parts in order, a part repeated. A json_schema is
the first alone; a forced tool call is the rest (data/tool_calls.py: Hermes' calls are
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, one or more).

    {"json": SCHEMA}                     an instance of SCHEMA ("lenient": true reads past
                                         assertions the grammar cannot keep)
    {"literal": TEXT}                    TEXT as it is
    {"sequence": [PART, ...]}            the parts, one after another
    {"repeat": PART, "min": 1, "max": N, "separator": TEXT}
                                         PART min to max times (max null: no limit),
                                         TEXT between two
    {"choice": [PART, ...]}              one of the parts
    {"text_until": TEXT}                 any text up to and including the first TEXT
                                         (a thinking model's reasoning up to </think>)
    {"blank": N}                         up to N spaces and newlines, or none
    {"marker": TEXT}                     TEXT, which the vocabulary writes as a token of
                                         its own (<think>)
    {"special": TEXT}                    the special token TEXT (Mistral's [TOOL_CALLS]),
                                         or TEXT spelt out
"""

from __future__ import annotations

from typing import Any, Mapping

from transduce.decode.json_grammar import (Blank, Choice, Literal, Marker, Node, Repeat, Root,
                                           Sequence, Special, TextUntil)
from transduce.decode.json_schema import SchemaError, schema_node

FORMS = ("json", "literal", "sequence", "repeat", "choice", "text_until", "blank", "marker",
         "special")


def compile_grammar(spec: Mapping[str, Any], name: str = "grammar") -> Root:
    """The grammar of a whole reply of `spec`; a spec that is none is a SchemaError
    naming its place from `name`."""
    return Root(_part(spec, name))


def _part(spec: Any, where: str) -> Node:
    forms = [form for form in FORMS if isinstance(spec, Mapping) and form in spec]
    if len(forms) != 1:
        raise SchemaError(f"{where}: a part is an object with one of {', '.join(FORMS)}, "
                          f"not {spec!r}")
    form = forms[0]
    if form == "json":
        return schema_node(spec["json"], f"{where}.json", bool(spec.get("lenient")))
    if form == "special":
        return Special(_text(spec[form], f"{where}.{form}").decode("utf-8"))
    if form in ("literal", "marker", "text_until"):
        text = _text(spec[form], f"{where}.{form}")
        return {"literal": Literal, "marker": Marker, "text_until": TextUntil}[form](text)
    if form == "blank":
        most = spec["blank"]
        if type(most) is not int or most < 1:
            raise SchemaError(f"{where}.blank: an integer >= 1, not {most!r}")
        return Blank(most)
    if form in ("sequence", "choice"):
        parts = spec[form]
        if not isinstance(parts, list) or not parts:
            raise SchemaError(f"{where}.{form}: a non-empty list of parts")
        nodes = [_part(part, f"{where}.{form}[{i}]") for i, part in enumerate(parts)]
        return Sequence(nodes) if form == "sequence" else Choice(nodes)
    low, high, separator = spec.get("min", 1), spec.get("max"), spec.get("separator")
    if type(low) is not int or low < 1 or high is not None and (
            type(high) is not int or high < low):
        raise SchemaError(f"{where}: min an integer >= 1, max null or >= min; not "
                          f"{low!r} and {high!r}")
    return Repeat(_part(spec["repeat"], f"{where}.repeat"), low, high,
                  None if separator is None else Literal(_text(separator,
                                                               f"{where}.separator")))


def _text(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise SchemaError(f"{where}: a non-empty text, not {value!r}")
    return value.encode("utf-8")
