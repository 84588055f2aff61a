"""Property-based fuzz of the API: whatever a client sends, the answer is never a 5xx.

The fields of each POST route are read from /openapi.json, so a field added later is
fuzzed too. Bodies mix the right names with values of every JSON type (lone surrogates,
NaN, huge numbers, nesting), unknown names, and raw bytes that are not JSON at all.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import client_for


# Texts cut because the client asked ("truncate": true) are still reported by the library.
pytestmark = pytest.mark.filterwarnings("ignore:line .* truncated to the model's limit")

WORDS = ["uno", "dos", "el perro", "gato rojo grande", "", " ", "casa\n", "ñandú ü €"]
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.integers(-3, 50) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from(WORDS) | st.text(max_size=30)
           | st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e", "4", "true", "encoder"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


# Bounds of a union of number types, as pydantic writes them -> JSON schema's names.
BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def from_schema(schema: dict, schemas: dict):
    """Values a JSON schema (as FastAPI writes it) allows, and some just past its bounds."""
    if "$ref" in schema:
        return from_schema(schemas[schema["$ref"].rsplit("/", 1)[1]], schemas)
    if "anyOf" in schema:        # a number's bounds, pydantic writes beside its types
        bounds = {name: schema[key] for key, name in BOUNDS.items() if key in schema}
        return st.one_of([from_schema({**bounds, **s} if s.get("type") in ("number", "integer")
                                      else s, schemas) for s in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if "examples" in schema:
        examples = st.sampled_from(schema["examples"])
        return st.one_of(examples, examples, examples, from_schema(
            {k: v for k, v in schema.items() if k != "examples"}, schemas))
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -5))
        high = min(schema.get("maximum", low + 60), low + 60)
        return st.integers(low - 2, high + 2)
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1.0))
        high = schema.get("maximum", schema.get("exclusiveMaximum", low + 5))
        return st.floats(low - 1, high + 1)
    if kind == "boolean":
        return st.booleans()
    if kind == "string" and "pattern" in schema:           # a function's name
        matching = st.from_regex(schema["pattern"], fullmatch=True)
        return st.one_of(matching, matching, matching, st.text(max_size=8))
    if kind == "string":
        return st.sampled_from(WORDS + ["es", "en", "auto", "text"]) \
            | st.text(max_size=schema.get("maxLength", 140) + 2)
    if kind == "array":
        items = from_schema(schema.get("items", {}), schemas)
        return st.lists(items, min_size=max(0, schema.get("minItems", 0) - 1), max_size=6)
    if kind == "null":
        return st.none()
    if kind == "object" and "patternProperties" in schema:     # a mapping (logit_bias)
        (pattern, spec), = schema["patternProperties"].items()
        keys = st.from_regex(pattern, fullmatch=True) | st.text(max_size=4)
        return st.dictionaries(keys, from_schema(spec, schemas), max_size=3)
    if kind == "object" and "properties" in schema:        # a nested model (chat messages)
        fields, required = schema["properties"], schema.get("required", [])
        return st.fixed_dictionaries(
            {name: from_schema(fields[name], schemas) for name in required},
            optional={name: from_schema(spec, schemas) for name, spec in fields.items()
                      if name not in required})
    return values


def bodies(schema: dict, schemas: dict):
    """Serialised bodies: objects that follow the schema (each field plausible, or any
    JSON value now and then), with fields left out or unknown ones added; any JSON
    value; raw bytes. Escaped, so that lone surrogates survive."""
    fields = schema["properties"]
    required = st.fixed_dictionaries({name: from_schema(fields[name], schemas)
                                      for name in schema.get("required", [])})
    optional = st.dictionaries(st.sampled_from(sorted(fields)), values, max_size=2)
    good = st.fixed_dictionaries({}, optional={name: from_schema(spec, schemas)
                                               for name, spec in fields.items()})
    extra = st.dictionaries(st.text(min_size=1, max_size=6), values, max_size=1)
    objects = st.builds(lambda a, b, c, d: {**a, **b, **c, **d}, good, required,
                        st.one_of(st.just({}), st.just({}), optional),
                        st.one_of(st.just({}), st.just({}), st.just({}), extra))
    encode = lambda body: json.dumps(body, ensure_ascii=True).encode()  # noqa: E731
    return st.one_of(objects.map(encode), objects.map(encode), objects.map(encode),
                     values.map(encode), st.binary(max_size=60))


def post_routes(client) -> tuple[dict[str, dict], dict]:
    """POST route -> its body's JSON schema, from the OpenAPI document; and the named
    schemas it refers to."""
    document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    found = {}
    for path, operations in document["paths"].items():
        if "post" in operations:
            content = operations["post"]["requestBody"]["content"]
            schema = next(iter(content.values()))["schema"]
            if "$ref" in schema:
                schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
            found[path] = schema
    defined = {k: v for schema in found.values() for k, v in schema.get("$defs", {}).items()}
    return found, {**schemas, **defined}


def fuzz(client, path: str, schema: dict, schemas: dict) -> list[int]:
    statuses = []

    @settings(max_examples=250, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(schema, schemas), content_type=st.sampled_from(
        ["application/json"] * 6 + ["application/x-www-form-urlencoded", "text/plain", ""]))
    def check(body, content_type):
        headers = {"content-type": content_type} if content_type else {}
        answer = client.post(path, content=body, headers=headers)
        statuses.append(answer.status_code)
        assert answer.status_code < 500, (path, body, answer.text)
        if answer.status_code >= 400:
            assert answer.json()["error"]

    check()
    return statuses


@pytest.fixture(scope="module")
def instruct(tool_caller):
    """A language model with a chat template that takes tools, whose
    /v1/chat/completions answers."""
    return tool_caller.generator


@pytest.mark.parametrize("kind", ["translator", "generator", "encoder", "instruct", "reranker"])
def test_no_request_gets_a_5xx(kind, request):
    model = request.getfixturevalue(kind)
    with client_for(model, max_chars=120, max_texts=4) as client:
        routes, schemas = post_routes(client)
        assert routes
        for path, schema in routes.items():
            statuses = fuzz(client, path, schema, schemas)
            if kind == "generator" and path == "/v1/chat/completions":
                assert set(statuses) <= {400, 413, 415, 422}, sorted(set(statuses))
                continue                     # no chat template: every chat is refused
            # the fuzz reaches the model, and the refusals, on every route
            assert statuses.count(200) >= 5 and len(set(statuses) - {200}) >= 2, \
                (path, sorted(set(statuses)))
        metrics = client.get("/metrics").text
    assert 'status="5' not in metrics
