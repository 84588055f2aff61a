"""Tools on /v1/chat/completions: the tools reach the model's template as transformers
passes them, its calls come apart from its text (whole and streamed to the same calls,
finish_reason "tool_calls"), calls and results go back through the history, OpenAI's
client reads the calls, and what cannot be done is 422 naming the field."""

import json

import pytest

from tests.chat_models import ASKS, CONVERSATIONS, GREETING, GREETS, TOOLS, template_ids
from tests.serve.conftest import client_for
from tests.serve.test_server import ServerThread
from transduce.serve.app import create_app

CALLED = [{"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
          {"name": "get_time", "arguments": "{}"}]
ASKED = {"messages": ASKS, "tools": TOOLS, "temperature": 0, "max_tokens": 60}


@pytest.fixture()
def api(tool_caller):
    with client_for(tool_caller.generator, max_chars=2000, max_texts=16) as client:
        yield client


def _stream(api, request) -> list[dict]:
    with api.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
        assert r.status_code == 200
        blocks = [block for block in "".join(r.iter_text()).split("\n\n") if block]
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-1]]


def test_models_say_how_calls_are_read(api, chatml):
    """/v1/models: a template that takes tools names the way its calls are read; one
    that takes none says null."""
    assert api.get("/v1/models").json()["data"][0]["tool_calls"] == "hermes"
    with client_for(chatml.generator) as client:
        model = client.get("/v1/models").json()["data"][0]
    assert model["chat"] is True and model["tool_calls"] is None


def test_a_reply_of_calls_comes_back_as_tool_calls(api, tool_caller):
    """The model's two <tool_call> blocks as two calls with ids of their own, no content,
    finish_reason tool_calls; the prompt is the one transformers lays out with the
    tools."""
    body = api.post("/v1/chat/completions", json=ASKED).json()
    (choice,) = body["choices"]
    calls = choice["message"]["tool_calls"]
    assert [call["function"] for call in calls] == CALLED
    assert {call["type"] for call in calls} == {"function"}
    assert len({call["id"] for call in calls}) == 2
    assert all(call["id"].startswith("call_") for call in calls)
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls"
    assert body["usage"]["prompt_tokens"] == len(template_ids(tool_caller.hf_dir, ASKS,
                                                              tools=TOOLS))


def test_streamed_calls_are_the_whole_replys(api):
    """Streamed: each call in one delta of its own index, whole, after the text; the
    finish chunk says tool_calls."""
    chunks = _stream(api, ASKED)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    calls = [call for delta in deltas for call in delta.get("tool_calls", ())]
    assert [call["index"] for call in calls] == [0, 1]
    assert [call["function"] for call in calls] == CALLED
    assert "".join(delta.get("content") or "" for delta in deltas) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_one_call_at_most_without_parallel_calls(api):
    body = api.post("/v1/chat/completions",
                    json={**ASKED, "parallel_tool_calls": False}).json()
    assert [call["function"] for call in body["choices"][0]["message"]["tool_calls"]] == \
        CALLED[:1]
    streamed = _stream(api, {**ASKED, "parallel_tool_calls": False})
    assert sum(len(chunk["choices"][0]["delta"].get("tool_calls", ()))
               for chunk in streamed if chunk["choices"]) == 1


def test_a_reply_in_text_is_content(api):
    """Given tools, a reply that calls none is text, finish_reason stop, whole and
    streamed."""
    request = {**ASKED, "messages": GREETS}
    (choice,) = api.post("/v1/chat/completions", json=request).json()["choices"]
    assert choice["message"]["content"] == GREETING and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    deltas = [chunk["choices"][0]["delta"] for chunk in _stream(api, request)
              if chunk["choices"]]
    assert "".join(delta.get("content") or "" for delta in deltas) == GREETING


def test_tool_choice_none_shows_the_model_no_tools(api, tool_caller):
    """The prompt is the conversation's alone; whatever the reply writes is text."""
    body = api.post("/v1/chat/completions", json={**ASKED, "tool_choice": "none"}).json()
    assert body["usage"]["prompt_tokens"] == len(template_ids(tool_caller.hf_dir, ASKS))
    (choice,) = body["choices"]
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] != "tool_calls"
    assert isinstance(choice["message"]["content"], str)


def test_calls_and_results_go_back_through_the_history(api, tool_caller):
    """An assistant turn of calls (content null, the arguments JSON text as the API gave
    them) and the tools' results: the template writes them as transformers does with the
    arguments as objects."""
    calls = [{"id": f"call_{k}", "type": "function", "function": called}
             for k, called in enumerate(CALLED)]
    history = [*ASKS, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
               {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    body = api.post("/v1/chat/completions", json={**ASKED, "messages": history,
                                                  "max_tokens": 4})
    assert body.status_code == 200, body.text
    as_objects = [{**m, "tool_calls": [
        {**call, "function": {**call["function"],
                              "arguments": json.loads(call["function"]["arguments"])}}
        for call in m["tool_calls"]]} if "tool_calls" in m else m for m in history]
    expected = template_ids(tool_caller.hf_dir, as_objects, tools=TOOLS)
    assert body.json()["usage"]["prompt_tokens"] == len(expected)
    assert "sunny, 21 C" in tool_caller.generator.tokenizer.decode(expected)


def test_openais_client_reads_the_calls(tool_caller):
    openai = pytest.importorskip("openai")
    with ServerThread(create_app(tool_caller.generator, name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        request = dict(model="tiny", messages=ASKS, tools=TOOLS, temperature=0,
                       max_tokens=60)
        whole = client.chat.completions.create(**request).choices[0]
        chunks = list(client.chat.completions.create(**request, stream=True))
        history = [*ASKS, whole.message.model_dump(exclude_none=True),   # as docs/serving.md
                   *({"role": "tool", "tool_call_id": call.id, "content": "sunny"}
                     for call in whole.message.tool_calls)]
        after = client.chat.completions.create(**{**request, "messages": history,
                                                  "max_tokens": 2})
    assert whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
        [(called["name"], called["arguments"]) for called in CALLED]
    streamed = [call for chunk in chunks if chunk.choices
                for call in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == \
        [(k, called["name"], called["arguments"]) for k, called in enumerate(CALLED)]
    assert after.usage.prompt_tokens > len(template_ids(tool_caller.hf_dir, ASKS, tools=TOOLS))


TOOL = TOOLS[0]


@pytest.mark.parametrize("change,field,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_date"}}},
     "tool_choice.function.name", "'get_date' is not among the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "a forced tool call is the reply's form"),
    ({"tool_choice": "required", "tools": [TOOLS[0], {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}}]},
     "tools[1].function.parameters", "'int' is not a JSON type"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "give it with tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
    ({"tools": [TOOL], "functions": [TOOL["function"]]}, "functions", "unknown field"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content",
     "expected a string"),
    ({"messages": [*ASKS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{'a'"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
    ({"messages": [*ASKS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "a JSON object"),
])
def test_bad_tool_requests_are_422_naming_the_field(api, change, field, words):
    request = {k: v for k, v in {**ASKED, **change}.items() if v is not None}
    answer = api.post("/v1/chat/completions", json=request)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and words in error["message"], error


def test_tools_for_a_template_without_them_are_422(chatml):
    """A template that never reads tools would drop them without a word: refused."""
    with client_for(chatml.generator, max_chars=2000, max_texts=16) as client:
        answer = client.post("/v1/chat/completions",
                             json={"messages": CONVERSATIONS[0], "tools": TOOLS})
        ignored = client.post("/v1/chat/completions", json={
            "messages": CONVERSATIONS[0], "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 2})
    assert answer.status_code == 422
    assert answer.json()["error"]["param"] == "tools"
    assert "takes no tools" in answer.json()["error"]["message"]
    assert ignored.status_code == 200


def test_tools_for_a_template_that_writes_calls_another_way_are_422(chatml, monkeypatch):
    """A template that takes tools but shows calls in no way the server reads: its model's
    calls would come back as text, so the request is refused naming the ways it reads."""
    from transduce.data.chat import ChatTemplate

    template = ("{% for tool in tools or [] %}{{ tool.function.name }}{% endfor %}"
                "{% for message in messages %}{{ message.content }}{% endfor %}")
    monkeypatch.setattr(chatml.generator.tokenizer, "chat_template", ChatTemplate(template))
    with client_for(chatml.generator, max_chars=2000, max_texts=16) as client:
        answer = client.post("/v1/chat/completions",
                             json={"messages": CONVERSATIONS[0], "tools": TOOLS})
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "tools"
    assert "none of the ways this server reads" in answer.json()["error"]["message"]


def _calls(body):
    (choice,) = body["choices"]
    return choice, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in choice["message"]["tool_calls"]]


def test_required_forces_calls_where_the_model_would_answer_in_text(api):
    """The greeting's reply is text unforced; "required" makes it calls of the tools,
    each's arguments an instance of its parameters, and where the model calls anyway
    the forced reply is its own."""
    jsonschema = pytest.importorskip("jsonschema")
    greeted = {"messages": GREETS, "tools": TOOLS, "temperature": 0, "max_tokens": 200}
    free = api.post("/v1/chat/completions", json=greeted).json()["choices"][0]
    assert free["message"]["content"] == GREETING and not free["message"]["tool_calls"]
    for request in (greeted, {**greeted, "temperature": 1.0, "seed": 3}):
        choice, calls = _calls(api.post("/v1/chat/completions",
                                        json={**request, "tool_choice": "required"}).json())
        assert choice["finish_reason"] == "tool_calls" and calls
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for name, arguments in calls:
            jsonschema.validate(arguments, parameters[name])
    forced = api.post("/v1/chat/completions", json={**ASKED, "tool_choice": "required"})
    assert [call["function"] for call in forced.json()["choices"][0]["message"][
        "tool_calls"]] == CALLED


def test_a_named_function_or_no_parallel_calls_force_one_call(api):
    named = {**ASKED, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    _, calls = _calls(api.post("/v1/chat/completions", json=named).json())
    assert [name for name, _ in calls] == ["get_time"]      # any object: its parameters
    _, one = _calls(api.post("/v1/chat/completions", json={
        **ASKED, "messages": GREETS, "tool_choice": "required",
        "parallel_tool_calls": False}).json())
    assert len(one) == 1
    streamed = [chunk for chunk in _stream(api, named) if chunk["choices"]]
    deltas = [call for chunk in streamed for call in chunk["choices"][0]["delta"].get(
        "tool_calls") or ()]
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] \
        == calls


BOUNDED = [{"type": "function", "function": {        # a random model's calls end soon
    "name": "get_weather", "parameters": {"type": "object", "required": ["city", "days"],
        "properties": {"city": {"enum": ["Tokyo", "Paris"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.mark.parametrize("template", ["MISTRAL_TOOLS", "MISTRAL_ARGS_TOOLS"])
def test_mistral_s_calls_are_forced_with_their_special_tokens(tmp_path, template):
    """A random model whose template writes calls Mistral's way, [TOOL_CALLS] (and
    [ARGS]) special tokens: "required" makes its reply calls, each an instance of its
    function's parameters, read back as tool_calls; a named function gives one call."""
    jsonschema = pytest.importorskip("jsonschema")
    import tests.chat_models as chat_models

    model = chat_models.mistral_tool_model(tmp_path, getattr(chat_models, template))
    request = {"messages": GREETS, "tools": BOUNDED, "tool_choice": "required",
               "max_tokens": 200, "parallel_tool_calls": False}     # (else it may go on)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    with client_for(model.generator, max_chars=4000, max_texts=16) as api:
        for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3}):
            for choice in api.post("/v1/chat/completions",
                                   json={**request, **settings}).json()["choices"]:
                calls = choice["message"]["tool_calls"]
                assert choice["finish_reason"] == "tool_calls" and calls, choice
                for call in calls:
                    jsonschema.validate(json.loads(call["function"]["arguments"]),
                                        parameters[call["function"]["name"]])
        named = api.post("/v1/chat/completions", json={**request, "tool_choice": {
            "type": "function", "function": {"name": "get_time"}}}).json()
    (call,) = named["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
