"""/v1/chat/completions: OpenAI's shape, the library's replies (whole, streamed, in the
batches /v1/generate's prompts share), usage and finish reasons that count what was
generated, 4xx for what it cannot take, and OpenAI's own client reading all of it."""

import json
import threading

import pytest

from tests.chat_models import CONVERSATIONS, STEPS, THOUGHT, template_ids, thinking_model
from tests.serve.conftest import client_for
from tests.serve.test_server import ServerThread
from transduce.data.chat import Chat
from transduce.data.reasoning import reasoning_grammar, split_reasoning
from transduce.decode.sampling import prompt_seeds
from transduce.serve.app import create_app


@pytest.fixture()
def api(chatml):
    with client_for(chatml.generator, max_chars=200, max_texts=16) as client:
        yield client


def expected_reply(chatml, conversation, **settings):
    (row,) = chatml.generator.generate_rows([Chat.of(conversation)], **settings)
    (prompt,) = chatml.generator.encode([Chat.of(conversation)])
    completion = len(row.tokens) + (row.end_token is not None)
    return row.text, row.finish_reason, {"prompt_tokens": len(prompt),
                                         "completion_tokens": completion,
                                         "total_tokens": len(prompt) + completion}


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_a_reply_is_the_librarys_with_its_usage_and_finish_reason(api, chatml, index):
    conversation = CONVERSATIONS[index]
    answer = api.post("/v1/chat/completions", json={
        "model": "anything", "messages": conversation, "max_tokens": STEPS, "temperature": 0})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    text, reason, usage = expected_reply(chatml, conversation, max_new_tokens=STEPS)
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["id"].startswith("chatcmpl-") and body["created"] > 0
    assert body["choices"] == [{"index": 0, "finish_reason": reason, "logprobs": None,
                                "message": {"role": "assistant", "content": text,
                                            "reasoning_content": None, "tool_calls": []}}]
    assert body["usage"] == usage
    if index == 0:        # the end token besides eos ends it
        assert reason == "stop" and usage["completion_tokens"] == chatml.cut + 1


def test_logprobs_of_a_reply_are_transformers(api, chatml):
    """Each content token's log-probability and the likeliest in its place, against
    transformers' log-softmax after apply_chat_template's ids; the end token that stopped
    the reply is not content."""
    import torch

    body = api.post("/v1/chat/completions", json={
        "messages": CONVERSATIONS[0], "max_tokens": STEPS, "temperature": 0,
        "logprobs": True, "top_logprobs": 3}).json()
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    ids = template_ids(chatml.hf_dir, CONVERSATIONS[0])
    (row,) = chatml.generator.generate_rows([Chat.of(CONVERSATIONS[0])], max_new_tokens=STEPS)
    assert row.end_token == chatml.end and len(content) == len(row.tokens) == chatml.cut
    with torch.no_grad():
        logits = chatml.hf(torch.tensor([ids + row.tokens])).logits[0, len(ids) - 1:-1]
    rows = torch.log_softmax(logits.double(), dim=-1)
    expected = rows.gather(1, torch.tensor(row.tokens)[:, None])[:, 0]
    assert [t["logprob"] for t in content] == pytest.approx(expected.tolist(), abs=1e-4)
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    for token, place in zip(content, rows):
        assert token["bytes"] == list(token["token"].encode())
        values = [top["logprob"] for top in token["top_logprobs"]]
        assert 1 <= len(values) <= 3 and values == sorted(values, reverse=True)
        assert values[0] == pytest.approx(place.max().item(), abs=1e-4)
        assert token["logprob"] == max(values)          # greedy: the likeliest each time


def test_sampled_replies_follow_the_seed_and_the_default_length_fills_the_context(api, chatml):
    body = {"messages": CONVERSATIONS[1], "seed": 7, "top_p": 0.9, "max_completion_tokens": 9}
    first = api.post("/v1/chat/completions", json=body).json()
    assert first["choices"][0]["message"]["content"] == expected_reply(
        chatml, CONVERSATIONS[1], max_new_tokens=9, temperature=1.0, top_p=0.9, seed=7)[0]
    assert api.post("/v1/chat/completions", json=body).json()["choices"] == first["choices"]
    whole = api.post("/v1/chat/completions", json={"messages": CONVERSATIONS[2],
                                                   "temperature": 0}).json()
    room = chatml.generator.context - whole["usage"]["prompt_tokens"]
    assert whole["choices"][0]["message"]["content"] == expected_reply(
        chatml, CONVERSATIONS[2], max_new_tokens=room)[0]


@pytest.mark.parametrize("usage", [False, True])
def test_a_streamed_reply_is_openais_chunks_joined_to_the_whole(api, chatml, usage):
    request = {"messages": CONVERSATIONS[2], "max_tokens": STEPS, "temperature": 0,
               "stream": True, "stop": "zz",
               **({"stream_options": {"include_usage": True}} if usage else {})}
    with api.stream("POST", "/v1/chat/completions", json=request) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [block for block in "".join(answer.iter_text()).split("\n\n") if block]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text, reason, counts = expected_reply(chatml, CONVERSATIONS[2], max_new_tokens=STEPS,
                                          stop=("zz",))
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == counts
        chunks = chunks[:-1]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": reason}
    assert "".join(chunk["choices"][0]["delta"].get("content", "")
                   for chunk in chunks) == text


@pytest.mark.parametrize("stream", [False, True])
def test_n_replies_follow_their_seeds_whole_or_streamed(api, chatml, stream):
    """n sampled replies to one conversation, each from its own seed (prompt_seeds, as
    /v1/completions draws its n): the library's replies to the conversation given n
    times; usage counts the prompt once; streamed, each choice's chunks join to its
    reply, with its logprobs and finish reason."""
    request = {"messages": CONVERSATIONS[1], "n": 3, "seed": 5, "max_tokens": 8,
               "logprobs": True, **({"stream": True, "stream_options": {"include_usage": True}}
                                    if stream else {})}
    conversations = [Chat.of(CONVERSATIONS[1])] * 3
    rows = chatml.generator.generate_rows(conversations, max_new_tokens=8, temperature=1.0,
                                          seeds=prompt_seeds(5, 3))
    assert len({row.text for row in rows}) > 1                 # drawn, not one reply 3 times
    (prompt,) = chatml.generator.encode(conversations[:1])
    completion = sum(len(row.tokens) + (row.end_token is not None) for row in rows)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": completion,
             "total_tokens": len(prompt) + completion}
    if not stream:
        body = api.post("/v1/chat/completions", json=request).json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["message"]["content"] for c in body["choices"]] == [r.text for r in rows]
        assert [c["finish_reason"] for c in body["choices"]] == [r.finish_reason for r in rows]
        assert all(c["logprobs"]["content"] for c in body["choices"])
        assert body["usage"] == usage
        with client_for(chatml.generator, max_texts=2) as small:
            refused = small.post("/v1/chat/completions", json=request)
        assert refused.status_code == 413 and refused.json()["error"]["param"] == "n"
        assert "3 replies, more than the limit of 2" in refused.json()["error"]["message"]
        return
    with api.stream("POST", "/v1/chat/completions", json=request) as answer:
        events = [block for block in "".join(answer.iter_text()).split("\n\n") if block]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert chunks[-1]["usage"] == usage
    for index, row in enumerate(rows):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == row.text
        assert mine[-1]["finish_reason"] == row.finish_reason
        assert sum(c["logprobs"] is not None for c in mine) == 1


def test_a_streamed_reply_carries_the_whole_replys_logprobs_after_its_pieces(api):
    """The pieces stream as generated; the logprobs come in one chunk once the reply is
    whole and scored, the ones the answer without stream gives."""
    request = {"messages": CONVERSATIONS[1], "max_tokens": STEPS, "temperature": 0,
               "logprobs": True, "top_logprobs": 2}
    whole = api.post("/v1/chat/completions", json=request).json()["choices"][0]
    with api.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as answer:
        assert answer.status_code == 200
        events = [block for block in "".join(answer.iter_text()).split("\n\n") if block]
    choices = [json.loads(event.removeprefix("data: "))["choices"][0] for event in events[:-1]]
    scored = [c["logprobs"] for c in choices if c["logprobs"] is not None]
    assert len(scored) == 1 and scored[0] == whole["logprobs"]
    assert choices.index(next(c for c in choices if c["logprobs"])) == len(choices) - 2
    assert "".join(c["delta"].get("content", "") for c in choices) == \
        whole["message"]["content"] == "".join(t["token"] for t in scored[0]["content"])


def test_chats_and_prompts_share_the_continuous_batches(chatml):
    """Chat and generate requests at once, each answered as if alone."""
    answers = {}
    with client_for(chatml.generator, max_texts=16, window_ms=50) as client:
        def ask(name, path, body):
            answers[name] = client.post(path, json=body).json()
        threads = [threading.Thread(target=ask, args=(f"chat{i}", "/v1/chat/completions", {
            "messages": conversation, "max_tokens": STEPS, "temperature": 0}))
            for i, conversation in enumerate(CONVERSATIONS)]
        threads.append(threading.Thread(target=ask, args=("plain", "/v1/generate", {
            "prompts": ["Hello world!"], "max_new_tokens": STEPS})))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for i, conversation in enumerate(CONVERSATIONS):
        assert answers[f"chat{i}"]["choices"][0]["message"]["content"] == \
            expected_reply(chatml, conversation, max_new_tokens=STEPS)[0]
    assert answers["plain"]["generations"] == chatml.generator.generate(
        ["Hello world!"], max_new_tokens=STEPS)


@pytest.mark.parametrize("body,status,field,words", [
    ({"messages": []}, 422, "messages", "at least 1 item"),
    ({"messages": [{"role": "user"}]}, 422, "messages[0].content", "expected a string"),
    ({"messages": [{"role": "", "content": "a"}]}, 422, "messages[0].role", "at least 1"),
    ({"messages": [{"role": "user", "content": "a"}], "n": 0}, 422, "n", "greater than"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 422,
     "top_logprobs", "with logprobs true"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     422, "top_logprobs", "less than or equal to 20"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": []}, 422, "tools",
     "at least 1 item"),
    ({"messages": [{"role": "user", "content": "a"}], "functions": []}, 422, "functions",
     "unknown field"),
    ({"messages": [{"role": "user", "content": "a"}], "presence_penalty": 2.5}, 422,
     "presence_penalty", "less than or equal to 2"),
    ({"messages": [{"role": "user", "content": "a"}], "logit_bias": {"9999": 5}}, 422,
     "logit_bias", "token 9999 is not among the model's"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
      "max_completion_tokens": 4}, 422, "max_completion_tokens", "differ"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": -1}, 422, "temperature",
     "greater than or equal"),
    ({"messages": [{"role": "user", "content": "a " * 99}] * 3}, 413, "messages",
     "positions in all"),
    ({"messages": [{"role": "user", "content": "a" * 201}]}, 413, "messages[0]", "max_chars"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": [1]}, 422,
     "chat_template_kwargs", "valid dictionary"),
    ({"messages": [{"role": "user", "content": "a"}],
      "chat_template_kwargs": {"add_generation_prompt": False}}, 422, "chat_template_kwargs",
     "chat_template_kwargs.add_generation_prompt: the template's add_generation_prompt is "
     "set by the chat itself"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"eos_token": ""}},
     422, "chat_template_kwargs", "the template's eos_token is the model's special token"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"a-b": 1}}, 422,
     "chat_template_kwargs", "'a-b' is not a variable name"),
    ({"messages": [{"role": "user", "content": "a"}],
      "chat_template_kwargs": {f"v{i}": 1 for i in range(33)}}, 422, "chat_template_kwargs",
     "at most 32 items"),
])
def test_bad_requests_are_4xx_naming_the_field(api, body, status, field, words):
    answer = api.post("/v1/chat/completions", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]                    # in OpenAI's shape
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """vLLM's field: Qwen3's enable_thinking=false gives apply_chat_template's ids with it
    (counted in the usage) and the library's reply to them."""
    thinking = thinking_model(tmp_path)
    variables = {"enable_thinking": False}
    with client_for(thinking.generator, max_chars=200, max_texts=16) as client:
        answer = client.post("/v1/chat/completions", json={
            "messages": THOUGHT, "max_tokens": STEPS, "temperature": 0,
            "chat_template_kwargs": variables})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    prompt = template_ids(thinking.hf_dir, THOUGHT, **variables)
    assert prompt != template_ids(thinking.hf_dir, THOUGHT)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"]["content"] == thinking.generator.chat(
        THOUGHT, template_variables=variables, max_new_tokens=STEPS)


def test_a_model_without_a_template_answers_422(lm):
    answer = lm.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "uno"}]})
    assert answer.status_code == 422
    assert "this model has no chat template" in answer.json()["error"]["message"]
    model = lm.get("/v1/models").json()["data"][0]
    assert model["chat"] is False and model["tool_calls"] is None


def test_openais_client_reads_replies_whole_and_streamed(chatml):
    openai = pytest.importorskip("openai")
    with ServerThread(create_app(chatml.generator, name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = client.chat.completions.create(model="tiny", messages=CONVERSATIONS[1],
                                               max_tokens=STEPS, temperature=0)
        text, reason, usage = expected_reply(chatml, CONVERSATIONS[1], max_new_tokens=STEPS)
        assert whole.choices[0].message.content == text
        assert whole.choices[0].finish_reason == reason
        assert whole.usage.model_dump(include=set(usage)) == usage
        pieces = client.chat.completions.create(
            model="tiny", messages=CONVERSATIONS[1], max_tokens=STEPS, temperature=0,
            stream=True, stream_options={"include_usage": True})
        chunks = list(pieces)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.total_tokens == usage["total_tokens"]
        scored = client.chat.completions.create(model="tiny", messages=CONVERSATIONS[1],
                                                max_tokens=STEPS, temperature=0,
                                                logprobs=True, top_logprobs=2)
        content = scored.choices[0].logprobs.content
        assert "".join(t.token for t in content) == text
        assert all(len(t.top_logprobs) <= 2 and t.logprob <= 0 for t in content)
        streamed = client.chat.completions.create(model="tiny", messages=CONVERSATIONS[1],
                                                  max_tokens=STEPS, temperature=0,
                                                  logprobs=True, top_logprobs=2, stream=True)
        joined = [t for c in streamed if c.choices and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.content]
        assert [(t.token, t.logprob) for t in joined] == [(t.token, t.logprob) for t in content]
        several = client.chat.completions.create(
            model="tiny", messages=CONVERSATIONS[1], max_tokens=STEPS, n=2, seed=3,
            frequency_penalty=0.5, presence_penalty=0.5, logit_bias={"5": -100})
        assert [c.index for c in several.choices] == [0, 1]
        rows = chatml.generator.generate_rows(
            [Chat.of(CONVERSATIONS[1])] * 2, max_new_tokens=STEPS, temperature=1.0,
            frequency_penalty=0.5, presence_penalty=0.5, logit_bias={5: -100},
            seeds=prompt_seeds(3, 2))
        assert [c.message.content for c in several.choices] == [row.text for row in rows]


def test_a_thinking_models_reasoning_comes_apart_whole_and_streamed(reasoning):
    """The library's reply, split where it closes its reasoning: reasoning_content
    without the newlines around it, the answer without those opening it (as the template
    would write the reply back); streamed, the reasoning's chunks and then the
    answer's, joined to the same two parts."""
    thought, _, answer = reasoning.text.partition("</think>")
    request = {"messages": CONVERSATIONS[1], "max_tokens": 24, "temperature": 0,
               "logit_bias": reasoning.bias}
    with client_for(reasoning.generator, max_chars=200, max_texts=16) as client:
        message = client.post("/v1/chat/completions", json=request).json()[
            "choices"][0]["message"]
        with client.stream("POST", "/v1/chat/completions",
                           json={**request, "stream": True}) as answer_stream:
            events = [block for block in "".join(answer_stream.iter_text()).split("\n\n")
                      if block]
    assert message == {"role": "assistant", "content": answer.lstrip("\n"),
                       "reasoning_content": thought.strip("\n"), "tool_calls": []}
    deltas = [json.loads(event.removeprefix("data: "))["choices"][0]["delta"]
              for event in events[1:-2]]         # the role's chunk, the finish, [DONE]
    fields = [field for delta in deltas for field in delta]
    assert fields == sorted(fields, reverse=True) and "content" in fields  # reasoning first
    for field in ("reasoning_content", "content"):
        assert "".join(delta.get(field, "") for delta in deltas) == message[field]


def test_a_thinking_model_reasons_before_a_reply_kept_to_json(reasoning):
    """The template opens the reasoning block: the model reasons freely up to </think>
    (the library's greedy reply's reasoning), and what follows is kept to the schema, in
    content. This model's vocabulary spells no braces: the schema is a JSON boolean, and
    a JSON object is a 422 naming the field."""
    schema = {"type": "boolean"}
    request = {"messages": CONVERSATIONS[1], "max_tokens": 40, "temperature": 0,
               "logit_bias": reasoning.bias,
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "yes", "schema": schema}}}
    with client_for(reasoning.generator, max_chars=200, max_texts=16) as client:
        choice = client.post("/v1/chat/completions", json=request).json()["choices"][0]
    bias = {int(token): value for token, value in reasoning.bias.items()}
    free = reasoning.generator.chat(CONVERSATIONS[1], max_new_tokens=24, logit_bias=bias)
    kept = reasoning.generator.chat(
        CONVERSATIONS[1], max_new_tokens=40, logit_bias=bias,
        grammar=reasoning_grammar(json.dumps({"json": schema}), inside=True))
    thought, answer = split_reasoning(kept, inside=True)
    assert thought and thought == split_reasoning(free, inside=True)[0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] == thought
    assert choice["message"]["content"] == answer and answer.strip() in ("true", "false")
    with client_for(reasoning.generator, max_chars=200, max_texts=16) as client:
        braces = client.post("/v1/chat/completions", json={
            **request, "response_format": {"type": "json_object"}})
        generated = client.post("/v1/generate", json={"prompts": ["a"],
                                                       "json_schema": {"type": "object"}})
    assert braces.status_code == generated.status_code == 422
    assert braces.json()["error"]["param"] == "response_format"
    assert "no token of the model's vocabulary writes '\"'" in braces.json()["error"][
        "message"]
    assert generated.json()["field"] == "json_schema"


def test_an_earlier_replys_reasoning_reaches_the_template(reasoning):
    """An assistant turn given back with its reasoning_content (as the API answered it):
    the template writes it, as apply_chat_template does with the same messages."""
    history = [{"role": "user", "content": "In the beginning"},
               {"role": "assistant", "content": "God created.", "reasoning_content": "Gen"},
               {"role": "user", "content": "El niño"}]
    with client_for(reasoning.generator, max_chars=200, max_texts=16) as client:
        body = client.post("/v1/chat/completions", json={
            "messages": history, "max_tokens": 2, "temperature": 0}).json()
        plain = client.post("/v1/chat/completions", json={
            "messages": [{k: v for k, v in m.items() if k != "reasoning_content"}
                         for m in history], "max_tokens": 2, "temperature": 0}).json()
        bad = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a", "reasoning_content": 3}]})
    assert body["usage"]["prompt_tokens"] == len(template_ids(reasoning.hf_dir, history))
    assert body["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert bad.status_code == 422 and "reasoning_content" in bad.json()["error"]["param"]


def test_openais_client_reads_the_reasoning(reasoning):
    """reasoning_content reaches the `openai` package's message and chunk objects (as an
    extra field, as DeepSeek's API gives it)."""
    openai = pytest.importorskip("openai")
    thought, _, answer = reasoning.text.partition("</think>")
    with ServerThread(create_app(reasoning.generator, name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        request = dict(model="tiny", messages=CONVERSATIONS[1], max_tokens=24, temperature=0,
                       logit_bias=reasoning.bias)
        whole = client.chat.completions.create(**request).choices[0].message
        chunks = list(client.chat.completions.create(**request, stream=True))
    assert (whole.reasoning_content, whole.content) == (thought.strip("\n"),
                                                        answer.lstrip("\n"))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        whole.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.content


def test_content_as_text_parts_is_their_text_joined_by_newlines(api, chatml):
    """OpenAI's list of parts (sent by LangChain and the SDK's typed messages): text
    parts are the message's text, joined by newlines as vLLM joins them; an image part,
    or something that is no part, is a 422 naming it."""
    parts = [{"type": "text", "text": "El niño"}, {"type": "text", "text": "comió."}]
    request = {"max_tokens": 4, "temperature": 0}
    given = api.post("/v1/chat/completions", json={
        **request, "messages": [{"role": "user", "content": parts}]}).json()
    joined = api.post("/v1/chat/completions", json={
        **request, "messages": [{"role": "user", "content": "El niño\ncomió."}]}).json()
    assert given["choices"] == joined["choices"]
    assert given["usage"] == joined["usage"] == {**given["usage"], "prompt_tokens": len(
        template_ids(chatml.hf_dir, [{"role": "user", "content": "El niño\ncomió."}]))}
    for bad, words in (([{"type": "image_url", "image_url": {"url": "x"}}],
                        "content[0]: a part of type 'image_url'"),
                       ([parts[0], "comió"], "content[1]: not a part"),
                       ([], "content: 0 parts"),
                       ([{"type": "text", "text": "a", "extra": 1}],
                        "content[0]: a part of type 'text'")):
        answer = api.post("/v1/chat/completions", json={
            **request, "messages": [{"role": "user", "content": bad}]})
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["param"] == "messages[0]" and words in error["message"], error
