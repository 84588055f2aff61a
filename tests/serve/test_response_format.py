"""JSON replies: response_format on /v1/chat/completions and /v1/completions, json_schema
on /v1/generate. Every reply that ends is an instance (the reference validator says
so), streamed pieces join to the whole reply, OpenAI's client parses one into a
Pydantic model, and schemas generation cannot keep are 422 naming the place."""

import json
import re

import pytest

from tests.chat_models import ASKS
from tests.serve.conftest import client_for
from tests.serve.test_server import ServerThread
from transduce.serve.app import create_app

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "additionalProperties": False,
           "required": ["city", "celsius", "sunny"],
           "properties": {"city": {"enum": ["Tokyo", "Paris"]}, "celsius": {"type": "integer"},
                          "sunny": {"type": "boolean"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                 "strict": True}}
ASKED = {"messages": ASKS, "max_tokens": 80, "seed": 5}


@pytest.fixture()
def api(tool_caller):
    with client_for(tool_caller.generator, max_chars=4000, max_texts=16) as client:
        yield client


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_chat_reply_under_a_schema_is_an_instance(api, temperature):
    body = api.post("/v1/chat/completions", json={**ASKED, "response_format": FORMAT,
                                                  "temperature": temperature, "n": 3}).json()
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), WEATHER)
    free = api.post("/v1/chat/completions", json={**ASKED, "temperature": 0}).json()
    with pytest.raises(ValueError):                          # unconstrained, no JSON
        json.loads(free["choices"][0]["message"]["content"])


CHECKED = {"type": "object", "required": ["city", "celsius", "day", "note"],
           "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
                          "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
                          "day": {"type": "string", "format": "date"},
                          "note": {"type": "string", "maxLength": 8}}}


def test_a_reply_keeps_a_pattern_bounds_a_format_and_a_length(api):
    body = api.post("/v1/chat/completions", json={
        **ASKED, "max_tokens": 200, "temperature": 1.0, "n": 3, "response_format": {
            "type": "json_schema", "json_schema": {"name": "c", "schema": CHECKED}}}).json()
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        reply = json.loads(choice["message"]["content"])
        jsonschema.validate(reply, CHECKED)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", reply["day"])


def test_streamed_json_joins_to_the_whole_reply(api):
    request = {**ASKED, "response_format": {"type": "json_object"}, "temperature": 0.8}
    whole = api.post("/v1/chat/completions", json=request).json()["choices"][0]
    with api.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
        blocks = [b for b in "".join(r.iter_text()).split("\n\n") if b][:-1]
    chunks = [json.loads(block.removeprefix("data: ")) for block in blocks]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole["message"]["content"]
    assert text.lstrip().startswith("{")
    if whole["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_text_format_is_free_text(api):
    plain = api.post("/v1/chat/completions", json={**ASKED, "temperature": 0}).json()
    text = api.post("/v1/chat/completions", json={**ASKED, "temperature": 0,
                                                  "response_format": {"type": "text"}}).json()
    assert text["choices"] == plain["choices"]


def test_completions_and_generate_follow_a_schema(api):
    """(Whitespace is bounded, one newline and 16 spaces or tabs a gap: 200 tokens
    always reach the end of this schema's JSON.)"""
    completion = api.post("/v1/completions", json={
        "prompt": ["The weather:", "Answer:"], "max_tokens": 200, "temperature": 0,
        "response_format": FORMAT}).json()
    generated = api.post("/v1/generate", json={
        "prompts": ["The weather:", "Answer:"], "max_new_tokens": 200,
        "json_schema": WEATHER}).json()
    texts = [choice["text"] for choice in completion["choices"]]
    assert texts == generated["generations"]
    assert [choice["finish_reason"] for choice in completion["choices"]] == ["stop"] * 2
    for text in texts:
        jsonschema.validate(json.loads(text), WEATHER)


def test_openais_client_parses_a_reply_into_a_pydantic_model(tool_caller):
    """The SDK's parse(): it sends the model's strict schema and reads the reply back."""
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Weather(pydantic.BaseModel):
        city: Literal["Tokyo", "Paris"]
        celsius: int
        sunny: bool

    with ServerThread(create_app(tool_caller.generator, name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.parse(model="tiny", messages=ASKS, temperature=0,
                                              max_tokens=80, response_format=Weather)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Weather) and parsed.city in ("Tokyo", "Paris")


@pytest.mark.parametrize("route, change, field, words", [
    ("/v1/chat/completions", {"response_format": {**FORMAT, "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {
            "n": {"type": "array", "uniqueItems": True}}}}}},
     "response_format",
     "response_format.json_schema.schema.properties.n.uniqueItems: not enforced"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema.json_schema", "required field missing"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format",
     "'text', 'json_object', 'json_schema'"),
    ("/v1/chat/completions", {"response_format": {**FORMAT, "json_schema": {
        "name": "w", "schema": {"type": "strings"}}}}, "response_format",
     "'strings' is not a JSON type"),
    ("/v1/generate", {"json_schema": {"type": "string", "pattern": "(?=a)"}}, "json_schema",
     "json_schema.pattern: a lookaround"),
    ("/v1/generate", {"json_schema": WEATHER, "beam": 2}, "beam",
     "a json_schema is followed by greedy search and sampling"),
])
def test_what_cannot_be_followed_is_422_naming_the_place(api, route, change, field, words):
    base = ASKED if route == "/v1/chat/completions" else {"prompts": ["a"]}
    answer = api.post(route, json={**base, **change})
    assert answer.status_code == 422, answer.text
    body = answer.json()
    error = body["error"] if "param" in body.get("error", {}) else body
    found = error.get("param", error.get("field"))
    message = error.get("message", error.get("error"))
    assert found == field and words in message, body
