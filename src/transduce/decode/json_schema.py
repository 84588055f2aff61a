"""A JSON Schema compiled into the grammar generation follows (json_grammar.py): every
text the grammar allows is an instance of the schema.

Enforced: type (one or a list), properties with required (the keys are written in the
schema's order, the required ones always, and no others; additionalProperties matters
only for an object without properties), items and prefixItems with minItems and
maxItems, enum, const, anyOf and oneOf (oneOf as anyOf: an instance may match two),
allOf of one schema, $ref to the document itself, its $defs or definitions (recursion
included), pattern, minLength and maxLength, the formats in string_formats.FORMATS
(calendar dates, times, UUIDs, ...), minimum, maximum, their exclusive forms and
multipleOf (numbers are then written without an exponent), as Pydantic and OpenAI's
structured outputs write them; an enum's or const's values are kept to the rest of
their schema. Annotations (title, description,
default, examples, other formats, and a format beside a pattern) are read past.
Assertions the grammar cannot keep (uniqueItems, not, a pattern with a lookahead, ...)
are a SchemaError naming them, rather than output that looks checked and is not.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any, Callable, Mapping

from transduce.config import ConfigError
from transduce.decode.checked_values import Bound, BoundedNumber, CheckedString, NumberRange
from transduce.decode.json_grammar import (Array, Choice, Literal, Node, Number, Object, Root,
                                           String, advance, any_value, complete, start)
from transduce.decode.regex_automaton import PatternError, StringRule
from transduce.decode.string_formats import FORMATS

UNENFORCED = ("minProperties", "maxProperties", "uniqueItems", "contains", "minContains",
              "maxContains", "not", "if", "then", "else", "patternProperties",
              "propertyNames", "dependentRequired", "dependentSchemas",
              "unevaluatedProperties", "unevaluatedItems")
STRING_ASSERTIONS = ("pattern", "minLength", "maxLength", "format")
NUMBER_ASSERTIONS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                     "multipleOf")
# Assertions of one type of value, which a combinator beside them would leave unkept.
TYPED_ASSERTIONS = ("pattern", "minLength", "maxLength", *NUMBER_ASSERTIONS, "prefixItems")
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# The most nodes one schema compiles to, and the deepest it nests: a schema that would
# build more is refused.
MAX_NODES = 10_000
MAX_DEPTH = 64


class SchemaError(ConfigError):
    """A JSON Schema that generation cannot follow; names the place in it and why."""


def compile_schema(schema: Mapping[str, Any] | bool, name: str = "json_schema") -> Root:
    """The grammar of a whole text that is one instance of `schema` (a parsed JSON
    Schema; {} or True: any JSON value). Errors name places from `name`."""
    return Root(schema_node(schema, name))


def schema_node(schema: Mapping[str, Any] | bool, name: str = "json_schema",
                lenient: bool = False) -> Node:
    """The node of one instance of `schema`; lenient: assertions the grammar cannot keep
    are read past rather than refused (a tool's parameters, whose calls are forced)."""
    if schema is True or schema == {}:
        return any_value()
    if not isinstance(schema, Mapping):
        raise SchemaError(f"{name}: a JSON Schema is an object, not {schema!r}")
    return _Compiler(schema, lenient).node(schema, name)


class _Compiler:
    """One document's compilation: its $refs resolved once each, so that a recursive
    schema becomes a graph with a cycle."""

    def __init__(self, document: Mapping[str, Any], lenient: bool = False):
        self.document, self.lenient = document, lenient
        self.refs: dict[str, Choice] = {}
        self.count = self.depth = 0

    def node(self, schema: Any, where: str) -> Node:
        """The node of `schema`, found at `where`."""
        self._count(1, where)
        if self.depth >= MAX_DEPTH:
            raise SchemaError(f"{where}: the schema nests deeper than {MAX_DEPTH} levels")
        self.depth += 1
        try:
            return self._node(schema, where)
        finally:
            self.depth -= 1

    def _count(self, parts: int, where: str) -> None:
        self.count += parts
        if self.count > MAX_NODES:
            raise SchemaError(f"{where}: the schema builds more than {MAX_NODES} parts")

    def _node(self, schema: Any, where: str) -> Node:
        if schema is True or schema == {}:
            return any_value()
        if not isinstance(schema, Mapping):
            raise SchemaError(f"{where}: expected a schema (an object), not {schema!r}")
        for keyword in () if self.lenient else UNENFORCED:
            if keyword in schema:
                raise SchemaError(f"{where}.{keyword}: not enforced by generation here; "
                                  f"remove it from the schema (and check it after)")
        for keyword in ("$ref", "anyOf", "oneOf", "allOf"):
            beside = next((k for k in TYPED_ASSERTIONS if k in schema), None)
            if keyword in schema and beside and not self.lenient:
                raise SchemaError(f"{where}.{beside}: not enforced beside {keyword}; move "
                                  f"it into the schemas {keyword} names")
        if "$ref" in schema:
            return self._ref(schema, where)
        for keyword in ("const", "enum", "anyOf", "oneOf", "allOf"):
            if keyword in schema:
                node = KEYWORDS[keyword](self, schema[keyword], f"{where}.{keyword}")
                return self._kept(node, schema, where) if keyword in ("const", "enum") \
                    else node
        kinds = schema.get("type", _implied_type(schema))
        if isinstance(kinds, list) and kinds:
            return Choice([self._typed(schema, kind, where) for kind in kinds])
        return self._typed(schema, kinds, where)

    def _typed(self, schema: Mapping[str, Any], kind: Any, where: str) -> Node:
        if kind is None:
            return any_value()
        if kind not in TYPES:
            raise SchemaError(f"{where}.type: {kind!r} is not a JSON type; choose from "
                              f"{', '.join(TYPES)}")
        if kind == "object":
            return self._object(schema, where)
        if kind == "array":
            return self._array(schema, where)
        if kind == "string":
            return self._string(schema, where)
        if kind in ("number", "integer"):
            return self._number(schema, kind == "integer", where)
        return Choice([Literal(b"true"), Literal(b"false")]) if kind == "boolean" \
            else Literal(b"null")

    def _string(self, schema: Mapping[str, Any], where: str) -> Node:
        low, high = _counts(schema, "minLength", "maxLength", where)
        pattern, keyword = schema.get("pattern"), "pattern"
        if pattern is None and schema.get("format") in FORMATS:
            pattern, keyword = FORMATS[schema["format"]], "format"
        if pattern is not None and not isinstance(pattern, str):
            raise SchemaError(f"{where}.pattern: a regular expression, not {pattern!r}")
        if pattern is None and low == 0 and high is None:
            return String()
        try:
            rule = StringRule(pattern, low, high)
        except PatternError as error:
            if self.lenient and keyword == "pattern":
                return self._string({**schema, "pattern": None}, where)
            raise SchemaError(f"{where}.{keyword}: {error}") from None
        if not rule.live(rule.begin):
            lengths = f"{low} to {high}" if high is not None else f"{low} or more"
            raise SchemaError(f"{where}: no string of {lengths} characters matches its "
                              f"{keyword}")
        self._count(len(rule.moves), where)
        return CheckedString(rule)

    def _number(self, schema: Mapping[str, Any], integer: bool, where: str) -> Node:
        if not any(keyword in schema for keyword in NUMBER_ASSERTIONS):
            return Number(integer)
        values = {}
        for keyword in NUMBER_ASSERTIONS:
            value = schema.get(keyword)
            if isinstance(value, bool) and keyword.startswith("exclusive"):
                value = None                      # draft 4's flag, read with its bound
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value)):
                raise SchemaError(f"{where}.{keyword}: a finite number, not {value!r}")
            values[keyword] = None if value is None else _exact(value)
        step = values["multipleOf"]
        if step is not None and step <= 0:
            raise SchemaError(f"{where}.multipleOf: a number > 0, not {schema['multipleOf']}")
        if integer:                               # the integers that are multiples of it
            step = Fraction(step).numerator if step is not None else 1
        within = NumberRange(_bound(values, schema, "minimum", "exclusiveMinimum", max),
                             _bound(values, schema, "maximum", "exclusiveMaximum", min), step)
        if not within.reachable(b""):
            raise SchemaError(f"{where}: no {'integer' if integer else 'number'} of at most "
                              f"18 digits a part lies within its bounds")
        return BoundedNumber(within, integer)

    def _object(self, schema: Mapping[str, Any], where: str) -> Node:
        properties = schema.get("properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise SchemaError(f"{where}.required: a list of property names, not {required!r}")
        if properties is None:
            if required:
                raise SchemaError(f"{where}.required: names {required[0]!r}, but the object "
                                  f"has no properties to write it from")
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return Literal(b"{}")
            return Object(None, self.node(extra, f"{where}.additionalProperties"))
        if not isinstance(properties, Mapping):
            raise SchemaError(f"{where}.properties: an object of schemas, not {properties!r}")
        missing = [key for key in required if key not in properties]
        if missing:
            raise SchemaError(f"{where}.required: {missing[0]!r} is not among its properties")
        return Object([(Literal(_json(key)), self.node(value, f"{where}.properties.{key}"),
                        key in required) for key, value in properties.items()])

    def _array(self, schema: Mapping[str, Any], where: str) -> Node:
        low, high = _counts(schema, "minItems", "maxItems", where)
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaError(f"{where}.prefixItems: a list of schemas, not {prefix!r}")
        items = schema.get("items", True)
        if items is False and low > len(prefix):
            raise SchemaError(f"{where}: minItems {low} is more than its "
                              f"{len(prefix)} prefixItems, and items is false")
        return Array(None if items is False else self.node(items, f"{where}.items"), low,
                     high, [self.node(each, f"{where}.prefixItems[{i}]")
                            for i, each in enumerate(prefix)])

    def _ref(self, schema: Mapping[str, Any], where: str) -> Node:
        ref = schema["$ref"]
        if ref not in self.refs:
            self.refs[ref] = Choice()          # filled below; a cycle comes back to it
            self.refs[ref].options = [self.node(self._resolve(ref, where), ref)]
        return self.refs[ref]

    def _resolve(self, ref: Any, where: str) -> Any:
        """The schema a local $ref ("#", "#/$defs/Name", "#/definitions/Name") names."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}.$ref: {ref!r}; only references within the schema "
                              f"(#/$defs/...) are followed")
        found: Any = self.document
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(found, Mapping) or part not in found:
                raise SchemaError(f"{where}.$ref: {ref!r} names nothing in the schema")
            found = found[part]
        return found

    def _kept(self, node: Choice | Literal, schema: Mapping[str, Any], where: str) -> Node:
        """An enum's or a const's values that the rest of its schema (a type, a pattern,
        bounds) allows."""
        rest = {key: value for key, value in schema.items() if key not in ("enum", "const")}
        if not set(rest) & {"type", *TYPED_ASSERTIONS, *STRING_ASSERTIONS}:
            return node
        check = Root(self.node(rest, where))
        values = [each for each in (node.options if isinstance(node, Choice) else [node])
                  if complete(advance(start(check), each.text))]
        if not values:
            raise SchemaError(f"{where}: none of its enum or const values is an instance "
                              f"of the rest of the schema")
        return Choice(values)

    def _literals(self, values: Any, where: str) -> Node:
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{where}: a non-empty list of values, not {values!r}")
        self._count(len(values), where)
        return Choice([Literal(_json(value, where)) for value in values])

    def _const(self, value: Any, where: str) -> Node:
        return Literal(_json(value, where))

    def _any_of(self, schemas: Any, where: str) -> Node:
        if not isinstance(schemas, list) or not schemas:
            raise SchemaError(f"{where}: a non-empty list of schemas, not {schemas!r}")
        return Choice([self.node(each, f"{where}[{i}]") for i, each in enumerate(schemas)])

    def _all_of(self, schemas: Any, where: str) -> Node:
        if not isinstance(schemas, list) or len(schemas) != 1:
            raise SchemaError(f"{where}: only an allOf of one schema is followed (Pydantic "
                              f"writes one around a $ref); merge the others into it")
        return self.node(schemas[0], f"{where}[0]")


KEYWORDS: dict[str, Callable[[_Compiler, Any, str], Node]] = {
    "const": _Compiler._const, "enum": _Compiler._literals, "anyOf": _Compiler._any_of,
    "oneOf": _Compiler._any_of, "allOf": _Compiler._all_of}


def _implied_type(schema: Mapping[str, Any]) -> str | list[str] | None:
    """The type a schema without one means by its keywords (None: any; a list: any, with
    the assertions of each type kept where they are)."""
    if "properties" in schema or "required" in schema or "additionalProperties" in schema:
        return "object"
    if any(keyword in schema for keyword in ("items", "prefixItems", "minItems", "maxItems")):
        return "array"
    if any(keyword in schema for keyword in (*STRING_ASSERTIONS, *NUMBER_ASSERTIONS)):
        return ["object", "array", "string", "number", "boolean", "null"]
    return None


def _counts(schema: Mapping[str, Any], low_key: str, high_key: str,
            where: str) -> tuple[int, int | None]:
    """A schema's (minimum count, maximum count or None): lengths, numbers of items."""
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for keyword, value in ((low_key, low), (high_key, high)):
        if value is not None and (type(value) is not int or value < 0):
            raise SchemaError(f"{where}.{keyword}: an integer >= 0, not {value!r}")
    if high is not None and high < low:
        raise SchemaError(f"{where}: {high_key} {high} is below {low_key} {low}")
    return low, high


def _bound(values: dict[str, int | Fraction | None], schema: Mapping[str, Any], inclusive: str,
           exclusive: str, tighter: Callable) -> Bound | None:
    """The lower (tighter=max) or upper (min) end of a number's range."""
    ends = []
    if values[inclusive] is not None:
        ends.append(Bound(values[inclusive], schema.get(exclusive) is not True))
    if values[exclusive] is not None:
        ends.append(Bound(values[exclusive], False))
    if not ends:
        return None
    value = tighter(end.value for end in ends)
    return Bound(value, all(end.closed for end in ends if end.value == value))


def _exact(value: int | float) -> int | Fraction:
    """A schema's number as written (0.1 is 1/10, not the float's binary fraction), an
    int where it is whole (faster to compute with)."""
    exact = Fraction(str(value))
    return int(exact) if exact.denominator == 1 else exact


def _json(value: Any, where: str = "json_schema") -> bytes:
    """A value as the literal JSON text written for it (NaN and infinities, which
    Python's JSON reads, are no JSON: a SchemaError)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except ValueError:
        raise SchemaError(f"{where}: {value!r} holds a number JSON cannot write") from None
