"""A JSON Schema compiled into the grammar generation follows (json_grammar.py): every
text the grammar allows is an instance of the schema.

Enforced: type (one or a list), properties with required (the keys are written in the
schema's order, the required ones always, and no others; additionalProperties matters
only for an object without properties), items with minItems and maxItems, enum, const,
anyOf and oneOf (oneOf as anyOf: an instance may match two), allOf of one schema, and
$ref to the document itself, its $defs or definitions (recursion included), as
Pydantic and OpenAI's structured outputs write them. Annotations (title, description,
default, examples, format) are read past. Assertions the grammar cannot keep (pattern,
string lengths, numeric bounds, ...) are a SchemaError naming them, rather than output
that looks checked and is not.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from transduce.config import ConfigError
from transduce.decode.json_grammar import (Array, Choice, Literal, Node, Number, Object, Root,
                                           String, any_value)

UNENFORCED = ("pattern", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
              "exclusiveMaximum", "multipleOf", "minProperties", "maxProperties",
              "uniqueItems", "prefixItems", "contains", "minContains", "maxContains", "not",
              "if", "then", "else", "patternProperties", "propertyNames",
              "dependentRequired", "dependentSchemas", "unevaluatedProperties",
              "unevaluatedItems")
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
        if "$ref" in schema:
            return self._ref(schema, where)
        for keyword in ("const", "enum", "anyOf", "oneOf", "allOf"):
            if keyword in schema:
                return KEYWORDS[keyword](self, schema[keyword], f"{where}.{keyword}")
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
        return {"string": String, "number": Number, "integer": lambda: Number(integer=True),
                "boolean": lambda: Choice([Literal(b"true"), Literal(b"false")]),
                "null": lambda: Literal(b"null")}[kind]()

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
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        for keyword, value in (("minItems", low), ("maxItems", high)):
            if value is not None and (type(value) is not int or value < 0):
                raise SchemaError(f"{where}.{keyword}: an integer >= 0, not {value!r}")
        if high is not None and high < low:
            raise SchemaError(f"{where}: maxItems {high} is below minItems {low}")
        return Array(self.node(schema.get("items", True), f"{where}.items"), low, high)

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

    def _literals(self, values: Any, where: str) -> Node:
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{where}: a non-empty list of values, not {values!r}")
        self._count(len(values), where)
        return Choice([Literal(_json(value)) for value in values])

    def _const(self, value: Any, where: str) -> Node:
        return Literal(_json(value))

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


def _implied_type(schema: Mapping[str, Any]) -> str | None:
    """The type a schema without one means by its keywords (None: any)."""
    if "properties" in schema or "required" in schema or "additionalProperties" in schema:
        return "object"
    return "array" if "items" in schema or "minItems" in schema or "maxItems" in schema \
        else None


def _json(value: Any) -> bytes:
    """A value as the literal JSON text written for it."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8")
