"""/v1/completions: OpenAI's shape; completions equal to the library's (texts and token
ids, n per prompt with their seeds, whole and streamed); logprobs equal to transformers'
log-softmax for an imported Llama, the end token included; an evaluation harness's
loglikelihood request (lm-evaluation-harness's local-completions) answered with
transformers' sums; 4xx in OpenAI's shape for what it cannot take; OpenAI's client."""

import json

import pytest
import torch

from tests.chat_models import CONVERSATIONS, STEPS, template_ids
from tests.serve.conftest import client_for
from tests.serve.test_server import ServerThread
from transduce.decode.generate import PromptIds
from transduce.decode.sampling import prompt_seeds
from transduce.serve.app import create_app

PROMPTS = ["uno dos tres", "el gato come", ""]


@pytest.fixture()
def llama(chatml):
    with client_for(chatml.generator, max_chars=200, max_texts=16) as client:
        yield client


def hf_logprobs(chatml, ids):
    """transformers' log-softmax rows for each place of `ids` but the last (float64)."""
    with torch.no_grad():
        logits = chatml.hf(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1)


def test_completions_are_the_librarys_with_usage(lm, generator):
    answer = lm.post("/v1/completions", json={"model": "x", "prompt": PROMPTS[0],
                                              "temperature": 0})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    (row,) = generator.generate_rows([PROMPTS[0]], max_new_tokens=16)    # OpenAI's default
    (ids,) = generator.encode([PROMPTS[0]])
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": row.text, "logprobs": None,
                                "finish_reason": row.finish_reason}]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 16,
                             "total_tokens": len(ids) + 16}


def test_n_completions_per_prompt_follow_their_seeds(lm, generator):
    request = {"prompt": PROMPTS, "n": 2, "max_tokens": 6, "seed": 11, "top_k": 20}
    body = lm.post("/v1/completions", json=request).json()
    each = [prompt for prompt in PROMPTS for _ in range(2)]
    expected = generator.generate(each, max_new_tokens=6, temperature=1.0, top_k=20,
                                  seeds=prompt_seeds(11, len(each)))
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == expected
    assert len(set(expected)) > 2                    # drawn, not one text six times
    assert lm.post("/v1/completions", json=request).json()["choices"] == body["choices"]
    prompt_tokens = sum(len(ids) for ids in generator.encode(PROMPTS))
    assert body["usage"]["prompt_tokens"] == prompt_tokens


def test_penalties_and_bias_are_the_librarys(lm, generator):
    """OpenAI's frequency and presence penalties and logit bias, sampled and greedy."""
    settings = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "logit_bias": {"5": 3.0}}
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 4}):
        request = {"prompt": PROMPTS, "max_tokens": 10, **sampling, **settings}
        body = lm.post("/v1/completions", json=request).json()
        seeds = None if not sampling["temperature"] else prompt_seeds(4, len(PROMPTS))
        expected = generator.generate(PROMPTS, max_new_tokens=10, seeds=seeds,
                                      **{**sampling, **settings, "logit_bias": {5: 3.0}})
        assert [c["text"] for c in body["choices"]] == expected
        plain = generator.generate(PROMPTS, max_new_tokens=10, seeds=seeds, **sampling)
        assert expected != plain


def test_token_ids_are_read_as_they_are(lm, generator):
    ids = [[5, 6, 7], [1, 9]]
    body = lm.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0,
                                            "echo": True}).json()
    for choice, prompt in zip(body["choices"], ids):
        (expected,) = generator.generate([PromptIds(prompt)], max_new_tokens=5)
        assert choice["text"] == generator.tokenizer.decode(prompt) + expected
    single = lm.post("/v1/completions", json={"prompt": ids[0], "max_tokens": 5,
                                              "temperature": 0}).json()
    assert single["choices"][0]["text"] == body["choices"][0]["text"][
        len(generator.tokenizer.decode(ids[0])):]


def test_logprobs_are_transformers_and_end_with_the_end_token(llama, chatml):
    ids = template_ids(chatml.hf_dir, CONVERSATIONS[0])
    body = llama.post("/v1/completions", json={
        "prompt": ids, "max_tokens": STEPS, "temperature": 0, "echo": True,
        "logprobs": 3}).json()
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    (row,) = chatml.generator.generate_rows([PromptIds(ids)], max_new_tokens=STEPS)
    sequence = ids + row.tokens + [chatml.end]
    assert row.end_token == chatml.end and choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == chatml.cut + 1 == len(row.tokens) + 1
    assert len(logprobs["tokens"]) == len(sequence)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    rows = hf_logprobs(chatml, sequence)
    expected = rows.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-4)
    for place, top in enumerate(logprobs["top_logprobs"][1:]):
        best = rows[place].topk(3).values.tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best, abs=1e-4)
        assert logprobs["token_logprobs"][place + 1] in top.values()
    text = choice["text"]
    assert "".join(logprobs["tokens"][:-1]) == text
    assert logprobs["tokens"][-1] == chatml.generator.tokenizer.piece(chatml.end)
    assert logprobs["text_offset"][-1] == len(text)
    for piece, offset in zip(logprobs["tokens"][:-1], logprobs["text_offset"]):
        assert text[offset:offset + len(piece)] == piece
    for place in range(len(ids), len(sequence)):          # greedy: each the likeliest
        assert logprobs["token_logprobs"][place] == max(logprobs["top_logprobs"][place].values())


def test_a_harness_loglikelihood_request_gets_transformers_sums(llama, chatml):
    """lm-evaluation-harness's local-completions: [context + continuation] ids, echo,
    max_tokens 1, logprobs 1; it sums token_logprobs[len(context):-1] and calls the
    continuation greedy where each token's logprob is its place's best."""
    tokenizer = chatml.generator.tokenizer
    pairs = [("In the beginning", " God created"), ("El niño comió", " una manzana."),
             ("Hello", " world!")]
    requests = [(tokenizer.encode([c])[0], tokenizer.encode([c + x])[0]) for c, x in pairs]
    body = llama.post("/v1/completions", json={
        "prompt": [whole for _, whole in requests], "max_tokens": 1, "temperature": 0,
        "logprobs": 1, "echo": True, "seed": 1234}).json()
    for choice, (context, whole) in zip(body["choices"], requests):
        assert context == whole[:len(context)]
        logprobs = choice["logprobs"]
        found = sum(logprobs["token_logprobs"][len(context):-1])
        greedy = all(value == max(top.values()) for value, top in zip(
            logprobs["token_logprobs"][len(context):-1],
            logprobs["top_logprobs"][len(context):-1]))
        rows = hf_logprobs(chatml, whole)
        places = torch.arange(len(context) - 1, len(whole) - 1)
        targets = torch.tensor(whole[len(context):])
        assert found == pytest.approx(rows[places, targets].sum().item(), abs=1e-4)
        assert greedy == bool((rows[places].argmax(dim=-1) == targets).all())


def test_echo_without_completion_scores_a_text_prompt(lm, generator):
    body = lm.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 0,
                                            "echo": True, "logprobs": 0}).json()
    for choice, prompt, ids in zip(body["choices"], PROMPTS, generator.encode(PROMPTS[:2])):
        logprobs = choice["logprobs"]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        assert "".join(logprobs["tokens"]) == prompt
        assert len(logprobs["tokens"]) == len(ids) - 1          # the bos added is not echoed
        (scores,) = generator.token_logprobs([ids])
        assert logprobs["token_logprobs"] == pytest.approx(scores.logprobs, abs=1e-6)
        assert all(len(top) == 1 for top in logprobs["top_logprobs"])   # the token itself
    assert body["usage"]["completion_tokens"] == 0
    echoed = lm.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 0,
                                              "echo": True}).json()      # nothing to run
    assert echoed["choices"][0]["text"] == PROMPTS[0] and echoed["timings"]["decode_ms"] == 0


@pytest.mark.parametrize("usage,logprobs", [(False, None), (True, None), (False, 2)])
def test_streamed_choices_join_to_the_whole(lm, usage, logprobs):
    """With logprobs, each choice's come in one chunk once every choice is whole."""
    request = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 7, "seed": 3, "echo": True,
               **({"logprobs": logprobs} if logprobs is not None else {})}
    whole = lm.post("/v1/completions", json=request).json()
    streamed = {**request, "stream": True,
                **({"stream_options": {"include_usage": True}} if usage else {})}
    with lm.stream("POST", "/v1/completions", json=streamed) as answer:
        assert answer.status_code == 200
        events = [block for block in "".join(answer.iter_text()).split("\n\n") if block]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        chunks = chunks[:-1]
    texts, reasons, scored = [""] * 4, [None] * 4, [[] for _ in range(4)]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
        if choice["logprobs"] is not None:
            scored[choice["index"]].append(choice["logprobs"])
    assert texts == [c["text"] for c in whole["choices"]]
    assert reasons == [c["finish_reason"] for c in whole["choices"]]
    assert scored == [[] if c["logprobs"] is None else [c["logprobs"]]
                      for c in whole["choices"]]


@pytest.mark.parametrize("body,status,field,words", [
    ({}, 422, "prompt", "missing"),
    ({"prompt": []}, 422, "prompt", "give a text, a list of texts, token ids"),
    ({"prompt": [[1], []]}, 422, "prompt", "item [1] is []"),
    ({"prompt": [1, -2]}, 422, "prompt", "item [1] is -2, no token id"),
    ({"prompt": [[1], [2, "a"]]}, 422, "prompt", 'item [1][1] is "a"'),
    ({"prompt": [5, 300]}, 422, "prompt", "token 1 is 300, not an id of the model's"),
    ({"prompt": ["a", [5, 300]]}, 422, "prompt", "give a text"),
    ({"prompt": "uno", "max_tokens": 0}, 422, "max_tokens", "0 generates nothing"),
    ({"prompt": "uno", "max_tokens": 0, "echo": True, "stream": True}, 422, "max_tokens",
     "stream"),
    ({"prompt": "uno", "logprobs": 21}, 422, "logprobs", "less than or equal to 20"),
    ({"prompt": "uno", "best_of": 3}, 422, "best_of", "give n alone"),
    ({"prompt": "uno", "suffix": "x"}, 422, "suffix", "None"),
    ({"prompt": "uno", "logit_bias": {"five": 1}}, 422, "logit_bias.five", "pattern"),
    ({"prompt": "uno", "logit_bias": {"5": 101}}, 422, "logit_bias.5", "less than or equal"),
    ({"prompt": "uno", "logit_bias": {"300": 1}}, 422, "logit_bias",
     "token 300 is not among the model's"),
    ({"prompt": "uno", "frequency_penalty": 2.5}, 422, "frequency_penalty", "less than or"),
    ({"prompt": "uno", "presence_penalty": -3}, 422, "presence_penalty", "greater than or"),
    ({"prompt": "uno", "temperature": 0, "top_p": 0}, 422, "top_p", "greater than 0"),
    ({"prompt": "uno", "echo": "yes"}, 422, "echo", "valid boolean"),
    ({"prompt": "uno", "stop": ""}, 422, "stop", "at least 1"),
    ({"prompt": ["uno"] * 9, "n": 2}, 413, "n", "more than the limit of 16"),
    ({"prompt": ["uno", "a" * 201]}, 413, "prompt[1]", "max_chars"),
    ({"prompt": ["uno", "a b " * 49]}, 413, "prompt[1]", "positions in all"),
    ({"prompt": [1] * 64}, 413, "prompt", "positions in all"),
])
def test_bad_requests_are_4xx_in_openais_shape(lm, body, status, field, words):
    answer = lm.post("/v1/completions", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_openapi_describes_the_openai_routes_refusals_as_openais(chatml):
    with client_for(chatml.generator) as client:
        paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        schema = paths[path]["post"]["responses"]["422"]["content"]["application/json"]
        assert schema["schema"]["$ref"].endswith("/OpenAIErrorBody")
    schema = paths["/v1/generate"]["post"]["responses"]["422"]["content"]["application/json"]
    assert schema["schema"]["$ref"].endswith("/ErrorBody")


def test_openais_client_reads_completions_and_logprobs(chatml):
    openai = pytest.importorskip("openai")
    ids = template_ids(chatml.hf_dir, CONVERSATIONS[1])
    with ServerThread(create_app(chatml.generator, name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="tiny", prompt=[ids, ids[:5]],
                                          max_tokens=STEPS, temperature=0, logprobs=2,
                                          echo=True)
        assert len(whole.choices) == 2
        first = whole.choices[0]
        assert "".join(first.logprobs.tokens).startswith(first.text) and \
            first.logprobs.token_logprobs[0] is None
        stream = client.completions.create(model="tiny", prompt=[ids, ids[:5]],
                                           max_tokens=STEPS, temperature=0, stream=True)
        texts = ["", ""]
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [c.text[len(chatml.generator.tokenizer.decode(i)):]
                         for c, i in zip(whole.choices, [ids, ids[:5]])]
        with pytest.raises(openai.UnprocessableEntityError, match="best_of"):
            client.completions.create(model="tiny", prompt="Hola", best_of=2)
