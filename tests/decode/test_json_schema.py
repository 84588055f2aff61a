"""Schemas compiled to grammars: every text a random walk through the grammar writes is
an instance by the reference validator (jsonschema), instances in the schema's key
order are read whole, non-instances are refused, and what the grammar cannot keep is
refused by name."""

import datetime
import json
import random
import uuid
from enum import Enum
from typing import Literal, Optional

import pytest

from transduce.decode.json_grammar import advance, complete, ended, start
from transduce.decode.json_schema import SchemaError, compile_schema

jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")


class Color(str, Enum):
    RED = "red"
    GREEN = "green"


class Address(pydantic.BaseModel):
    city: str
    zip: Optional[str] = None


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]
    address: Address
    color: Color
    mood: Literal["calm", "busy"] = "calm"
    score: Optional[float] = None


class Booking(pydantic.BaseModel):                  # assertions generation keeps
    code: str = pydantic.Field(pattern=r"^[A-Z]{3}-\d{2,4}$")
    guests: int = pydantic.Field(ge=1, le=12)
    price: float = pydantic.Field(gt=0, lt=1000, multiple_of=0.25)
    note: str = pydantic.Field(min_length=2, max_length=12)
    when: datetime.datetime
    day: datetime.date
    at: datetime.time
    stay: datetime.timedelta
    id: uuid.UUID
    seat: tuple[int, str]
    rooms: list[pydantic.conint(multiple_of=3, lt=0)] = pydantic.Field(max_length=3)


class Tree(pydantic.BaseModel):
    value: int
    children: list["Tree"] = []


STRICT = {    # OpenAI's structured outputs: every key required, no others
    "type": "object", "additionalProperties": False, "required": ["steps", "answer", "ok"],
    "properties": {
        "steps": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "additionalProperties": False,
                            "required": ["why"], "properties": {"why": {"type": "string"}}}},
        "answer": {"type": ["integer", "null"]},
        "ok": {"type": "boolean"}}}
MIXED = {"type": "object", "title": "mixed", "description": "annotations are read past",
         "properties": {"kind": {"const": "point"},
                        "xy": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                               "maxItems": 2},
                        "label": {"anyOf": [{"type": "string", "format": "email"},
                                            {"type": "null"}]},
                        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
                        "none": {"type": "object", "additionalProperties": False}},
         "required": ["kind", "xy"]}
SCHEMAS = {"person": Person.model_json_schema(), "tree": Tree.model_json_schema(),
           "booking": Booking.model_json_schema(),
           "strict": STRICT, "mixed": MIXED, "object": {"type": "object"}, "any": {}}
# Bytes a walk favours, so that what it opens it soon closes.
WEIGHTS = {ord(c): w for c, w in {'"': 30, "}": 30, "]": 30, ",": 3, " ": 0.3, "\n": 0.1,
                                  "\\": 0.5}.items()}


def walk(root, rng, limit=3000):
    """A random text of the grammar: bytes drawn among those it allows, ASCII only."""
    state, text = start(root), b""
    while not ended(state) and len(text) < limit:
        if complete(state) and rng.random() < 0.3:
            break
        options = [(byte, advance(state, bytes([byte]))) for byte in range(0x80)]
        options = [(byte, after) for byte, after in options if after]
        if not options:                       # a number at its longest
            break
        byte, state = rng.choices(options, [WEIGHTS.get(b, 1) for b, _ in options])[0]
        text += bytes([byte])
    assert complete(state), text
    return text.decode()


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_text_the_grammar_writes_is_an_instance(name):
    schema, rng = SCHEMAS[name], random.Random(name)
    root = compile_schema(schema)
    for _ in range(40):
        jsonschema.validate(json.loads(walk(root, rng)), schema)


def test_what_the_grammar_writes_for_pydantic_s_assertions_pydantic_reads_back():
    root, rng = compile_schema(Booking.model_json_schema()), random.Random(2)
    for _ in range(20):
        Booking.model_validate_json(walk(root, rng))


def test_keys_come_in_the_schema_s_order_required_ones_always():
    root, rng = compile_schema(Person.model_json_schema()), random.Random(1)
    order = list(Person.model_fields)
    for _ in range(30):
        keys = list(json.loads(walk(root, rng)))
        assert keys == sorted(keys, key=order.index)
        assert {"name", "age", "tags", "address", "color"} <= set(keys)


INSTANCES = [
    ("person", Person(name="Ann", age=30, tags=["a", "b"], address=Address(city="Oslo"),
                      color=Color.RED, score=2.5).model_dump(mode="json")),
    ("person", {"name": "B", "age": -1, "tags": [], "address": {"city": "x", "zip": None},
                "color": "green"}),
    ("tree", {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}),
    ("strict", {"steps": [{"why": "because"}], "answer": None, "ok": True}),
    ("mixed", {"kind": "point", "xy": [1.5, -2], "label": None, "extra": {"a": 1},
               "none": {}}),
]
NON_INSTANCES = [
    ("person", {"name": "Ann", "age": 30}),                                # required missing
    ("person", {"name": "A", "age": 1.5, "tags": [], "address": {"city": "x"},
                "color": "red"}),                                          # not an integer
    ("person", {"name": "A", "age": 1, "tags": [], "address": {"city": "x"},
                "color": "blue"}),                                         # not in the enum
    ("strict", {"steps": [], "answer": 1, "ok": True}),                    # minItems
    ("strict", {"steps": [{"why": "a"}] * 4, "answer": 1, "ok": True}),    # maxItems
    ("strict", {"steps": [{"why": "a"}], "answer": 1, "ok": True, "x": 1}),  # an extra key
    ("strict", {"answer": 1, "steps": [{"why": "a"}], "ok": True}),        # out of order
    ("mixed", {"kind": "line", "xy": [1, 2]}),                              # not the const
    ("mixed", {"kind": "point", "xy": [1, 2], "none": {"a": 1}}),          # no keys allowed
]


@pytest.mark.parametrize("name, instance", INSTANCES)
@pytest.mark.parametrize("indent", [None, 2])
def test_instances_in_the_schema_s_order_are_read_whole(name, instance, indent):
    jsonschema.validate(instance, SCHEMAS[name])
    text = json.dumps(instance, indent=indent)
    assert complete(advance(start(compile_schema(SCHEMAS[name])), text.encode()))


@pytest.mark.parametrize("name, instance", NON_INSTANCES)
def test_what_is_no_instance_is_not_read_whole(name, instance):
    state = advance(start(compile_schema(SCHEMAS[name])), json.dumps(instance).encode())
    assert not (state and complete(state))


@pytest.mark.parametrize("schema, where", [
    ({"type": "array", "uniqueItems": True}, "json_schema.uniqueItems: not enforced"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?!a)"}}},
     "json_schema.properties.s.pattern: a lookaround"),
    ({"type": "string", "pattern": "(a)\\1"}, "json_schema.pattern: a backreference"),
    ({"type": "string", "pattern": "[a-"}, "json_schema.pattern: an unclosed '['"),
    ({"type": "string", "pattern": "(a{100}){100}"}, "more than 4000 places"),
    ({"type": "string", "pattern": "(" * 5000 + ")" * 5000}, "nested deeper than 64"),
    ({"type": "string", "minLength": 4, "maxLength": 3}, "maxLength 3 is below minLength 4"),
    ({"type": "string", "pattern": "^ab$", "maxLength": 1}, "no string of 0 to 1 characters"),
    ({"type": "string", "minLength": -1}, "json_schema.minLength: an integer >= 0"),
    ({"anyOf": [{"type": "string"}], "maxLength": 3},
     "json_schema.maxLength: not enforced beside anyOf"),
    ({"type": "integer", "minimum": 2, "maximum": 1}, "no integer of at most 18 digits"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no integer"),
    ({"type": "number", "multipleOf": 0}, "json_schema.multipleOf: a number > 0"),
    ({"type": "number", "minimum": "1"}, "json_schema.minimum: a finite number, not '1'"),
    ({"type": "number", "maximum": float("inf")}, "json_schema.maximum: a finite number"),
    ({"enum": [1, float("nan")]}, "json_schema.enum: nan holds a number JSON cannot"),
    ({"enum": ["a", "bb"], "maxLength": 0}, "none of its enum or const values"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2},
     "minItems 2 is more than its 1 prefixItems"),
    ({"type": "text"}, "json_schema.type: 'text' is not a JSON type"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "'a' is not among"),
    ({"$ref": "https://example.com/s.json"}, "only references within the schema"),
    ({"$ref": "#/$defs/Missing"}, "names nothing"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems 2 is below minItems 3"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf of one schema"),
    ({"enum": []}, "non-empty list"),
    ([1, 2], "a JSON Schema is an object"),
    (json.loads('{"items": ' * 80 + "{}" + "}" * 80), "nests deeper than 64 levels"),
    ({"anyOf": [{"enum": list(range(200))}] * 60}, "builds more than 10000 parts"),
])
def test_what_the_grammar_cannot_keep_is_refused_by_name(schema, where):
    with pytest.raises(SchemaError, match=where.replace("$", r"\$").replace(".", r"\.")
                       .replace("[", r"\[").replace("(", r"\(")):
        compile_schema(schema)
