"""Every endpoint through an in-process client: the answers equal the library's, and every
kind of bad input gets a 4xx JSON error that names the field and the problem."""

import json
import os
import re
import socket
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from tests.serve.conftest import SENTENCES, client_for
from transduce.attention_maps import attention_maps
from transduce.config import ConfigError
from transduce.decode.options import GenerateOptions
from transduce.model import Transformer
from transduce.serve.batcher import Batcher, Job


# Texts cut because the client asked ("truncate": true) are still reported by the library.
pytestmark = pytest.mark.filterwarnings("ignore:line .* truncated to the model's limit")


# ------------------------------------------------------------------------ translation

@pytest.mark.parametrize("settings", [{"beam": 1}, {"beam": 3, "nbest": 2, "alpha": 1.0},
                                      {"beam": 2, "max_length": 3}])
def test_v1_translate_equals_the_translator(mt, translator, settings):
    answer = mt.post("/v1/translate", json={"texts": SENTENCES + [""], **settings})
    assert answer.status_code == 200
    body = answer.json()
    offline = translator.translate_nbest(SENTENCES + [""], settings.get("nbest", 1),
                                         beam=settings["beam"], alpha=settings.get("alpha", 0.6),
                                         max_length=settings.get("max_length"))
    assert [t["text"] for t in body["translations"]] == [h[0].text for h in offline]
    assert [t["score"] for t in body["translations"]] == \
        pytest.approx([h[0].score for h in offline])
    if settings.get("nbest", 1) > 1:
        assert [[n["text"] for n in t["nbest"]] for t in body["translations"]] == \
               [[h.text for h in hs] for hs in offline]
    assert set(body["timings"]) == {"queue_ms", "decode_ms", "total_ms"}
    assert body["timings"]["total_ms"] >= body["timings"]["decode_ms"] > 0


def test_max_length_caps_the_output(mt, translator):
    short = mt.post("/v1/translate", json={"texts": ["uno dos"], "beam": 1, "max_length": 2})
    assert short.json()["translations"][0]["text"] == \
        translator.translate(["uno dos"], beam=1, max_length=2)[0]
    assert short.json()["translations"][0]["text"] != \
        translator.translate(["uno dos"], beam=1)[0]


@pytest.mark.parametrize("body,status,field,words", [
    ({"texts": ["a"], "beam": 2, "nbest": 3}, 422, "nbest", "more than beam"),
    ({"texts": ["a"], "max_length": 41}, 422, "max_length", "40 positions"),
    ({"texts": ["a"], "beam": 0}, 422, "beam", "greater than or equal to 1"),
    ({"texts": ["a"], "beam": 17}, 422, "beam", "less than or equal to 16"),
    ({"texts": ["a"], "alpha": -1}, 422, "alpha", "greater than or equal"),
    ({"texts": ["a"], "beam": "4"}, 422, "beam", "valid integer"),
    ({"texts": ["a"], "beam": 2.0}, 422, "beam", "valid integer"),
    ({"texts": ["a"], "beam": True}, 422, "beam", "valid integer"),
    ({"texts": ["a"], "truncate": "yes"}, 422, "truncate", "valid boolean"),
    ({"texts": []}, 422, "texts", "at least 1 item"),
    ({"texts": "uno"}, 422, "texts", "valid list"),
    ({"texts": ["uno", 3]}, 422, "texts[1]", "valid string"),
    ({"texts": ["uno", None]}, 422, "texts[1]", "valid string"),
    ({"texts": ["uno"], "colour": "red"}, 422, "colour", "unknown field"),
    ({}, 422, "texts", "required field missing"),
    ({"texts": ["x" * 201]}, 413, "texts[0]", "limit of 200 (max_chars)"),
    ({"texts": ["uno"] * 17}, 413, "texts", "limit of 16 per request (max_texts)"),
    ({"texts": ["uno", "uno " * 45]}, 413, "texts[1]", "model's limit of 39"),
])
def test_bad_bodies_are_refused_naming_the_field(mt, body, status, field, words):
    answer = mt.post("/v1/translate", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field
    assert words in answer.json()["error"] and answer.json()["error"].startswith(field)


@pytest.mark.parametrize("raw,content_type,status,words", [
    (b'{"texts": [', "application/json", 400, "malformed JSON"),
    (b'{"texts": ["\xff\xfe"]}', "application/json", 400, "UTF-8"),
    (b'["uno"]', "application/json", 422, "valid dictionary"),
    (b'null', "application/json", 422, "valid dictionary"),
    (b'{"texts": ["uno", "\\ud83d"]}', "application/json", 422,
     "texts[1]: contains a lone surrogate"),
    (b'texts=uno', "text/plain", 415, "content-type 'text/plain': send application/json"),
    (b'{"texts": ["uno"]}', "Application/JSON", 200, None),
    (b'{"texts": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "application/json", 400,
     "the JSON body is nested too deeply"),
    (b'{"texts": ["uno"], "beam": ' + b"1" * 5000 + b"}", "application/json", 400,
     "a number of more than 4300 digits"),
    (b'', "application/json", 422, "the body is missing"),
])
def test_unreadable_bodies_get_4xx(mt, raw, content_type, status, words):
    answer = mt.post("/v1/translate", content=raw, headers={"content-type": content_type})
    assert answer.status_code == status, answer.text
    assert words is None or words in answer.json()["error"]
    if status < 422:           # LibreTranslate's route reads the body alike (its own names)
        raw = raw.replace(b'"texts"', b'"target": "en", "q"')
        answer = mt.post("/translate", content=raw, headers={"content-type": content_type})
        assert answer.status_code == status, answer.text
        assert words is None or words in answer.json()["error"]


def test_long_texts_are_cut_only_when_asked(mt, translator):
    long = "uno " * 45
    assert mt.post("/v1/translate", json={"texts": [long]}).status_code == 413
    answer = mt.post("/v1/translate", json={"texts": ["uno", long], "truncate": True, "beam": 1})
    assert answer.status_code == 200
    assert [t["truncated"] for t in answer.json()["translations"]] == [False, True]
    with pytest.warns(UserWarning, match="truncated"):
        offline = translator.translate([long], beam=1)
    assert answer.json()["translations"][1]["text"] == offline[0]


def test_a_body_over_the_byte_limit_is_refused_before_reading_it_all(mt):
    huge = b'{"texts": ["' + b"a" * 4_000_000 + b'"]}'
    answer = mt.post("/v1/translate", content=huge, headers={"content-type": "application/json"})
    assert answer.status_code == 413 and "bytes" in answer.json()["error"]


def test_a_body_of_escaped_characters_within_max_chars_is_read(translator):
    """A character beyond the BMP is 12 bytes of JSON (two \\uXXXX escapes): texts of them
    within max_texts and max_chars are translated, not refused for the body's size."""
    texts = ["\U0001F600" * 2000] * 16                  # 16 x 2000 x 12 bytes: 384 kB
    with client_for(translator, max_texts=16, max_chars=2000) as client:
        body = json.dumps({"texts": texts, "truncate": True, "beam": 1})     # ASCII
        assert len(body) > 16 * 2000 * 12
        answer = client.post("/v1/translate", content=body,
                             headers={"content-type": "application/json"})
        assert answer.status_code == 200, answer.text


def test_a_full_queue_answers_429_with_retry_after(translator):
    with client_for(translator, max_queue=1) as client:
        batcher = client.app.state.service.batcher
        gate = threading.Event()
        held = batcher.submit(Job("hold", lambda jobs: [gate.wait(5)] * len(jobs), None, 1, 1))
        time.sleep(0.1)                      # the worker runs the held job
        queued = batcher.submit(Job("hold", lambda jobs: [None] * len(jobs), None, 1, 1))
        answer = client.post("/v1/translate", json={"texts": ["uno"]})
        gate.set()
        held.result(5), queued.result(5)
        assert answer.status_code == 429
        assert int(answer.headers["retry-after"]) >= 1
        assert "max_queue" in answer.json()["error"]
        assert client.post("/v1/translate", json={"texts": ["uno"]}).status_code == 200


# ---------------------------------------------------------------- LibreTranslate's API

def test_libretranslate_json_single_and_list(mt, translator):
    one = mt.post("/translate", json={"q": "el perro", "source": "es", "target": "en",
                                      "format": "text", "api_key": ""})
    assert one.status_code == 200
    assert one.json() == {"translatedText": translator.translate(["el perro"], beam=4)[0]}
    many = mt.post("/translate", json={"q": SENTENCES[:3], "source": "auto", "target": "en"})
    assert many.json()["translatedText"] == translator.translate(SENTENCES[:3], beam=4)
    assert many.json()["detectedLanguage"] == [{"confidence": 100.0, "language": "es"}] * 3


def test_libretranslate_form_and_alternatives(mt, translator):
    answer = mt.post("/translate", data={"q": "uno dos", "source": "es", "target": "en",
                                         "alternatives": "2"})
    assert answer.status_code == 200, answer.text
    nbest = translator.translate_nbest(["uno dos"], 3, beam=4)[0]
    assert answer.json() == {"translatedText": nbest[0].text,
                             "alternatives": [h.text for h in nbest[1:]]}


@pytest.mark.parametrize("body,status,field", [
    ({"q": "uno", "source": "fr", "target": "en"}, 400, "source"),
    ({"q": "uno", "source": "es", "target": "de"}, 400, "target"),
    ({"q": "uno", "source": "es"}, 422, "target"),
    ({"q": "uno", "target": "en", "format": "html"}, 422, "format"),
    ({"q": 5, "target": "en"}, 422, "q"),
    ({"q": [], "target": "en"}, 422, "q"),
    ({"q": ["uno", 5], "target": "en"}, 422, "q[1]"),
    ({"q": "x" * 201, "target": "en"}, 413, "q[0]"),
    ({"q": "uno", "target": "en", "alternatives": -1}, 422, "alternatives"),
    ({"q": "uno", "target": "en", "extra": 1}, 422, "extra"),
])
def test_libretranslate_bad_requests(mt, body, status, field):
    answer = mt.post("/translate", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field and answer.json()["error"]


def test_libretranslate_unreadable_bodies(mt):
    assert mt.post("/translate", content=b"{", headers={"content-type": "application/json"}
                   ).status_code == 400
    assert mt.post("/translate", content=b"q=\xff&target=en",
                   headers={"content-type": "application/x-www-form-urlencoded"}
                   ).status_code == 400
    assert mt.post("/translate", content=b"<q/>", headers={"content-type": "application/xml"}
                   ).status_code == 415
    form = {"content-type": "application/x-www-form-urlencoded"}
    for bad in (b"q=%FF&target=en", b"q=%ED%A0%80&target=en"):
        answer = mt.post("/translate", content=bad, headers=form)
        assert answer.status_code == 400 and "percent-encoded value that is not UTF-8" in \
            answer.json()["error"]
    answer = mt.post("/translate", content=b"q=uno&target=en&alternatives=" + b"1" * 5000,
                     headers=form)
    assert answer.status_code == 422 and answer.json()["field"] == "alternatives"


def test_languages(mt):
    assert mt.get("/languages").json() == [{"code": "es", "name": "Spanish", "targets": ["en"]}]


def test_the_pair_a_checkpoint_records_is_served_unless_given(translator, monkeypatch):
    monkeypatch.setattr(translator.model, "languages", ("de", "fr"))
    with client_for(translator) as client:
        assert client.get("/languages").json() == [{"code": "de", "name": "German",
                                                    "targets": ["fr"]}]
        assert client.post("/translate", json={"q": "uno", "source": "es", "target": "en"}
                           ).status_code == 400
    from transduce.serve.app import create_app
    with TestClient(create_app(translator, languages=("es", "en"))) as client:
        assert client.get("/languages").json()[0]["code"] == "es"


# ------------------------------------------------------------------------- attention

def test_attention_maps_are_those_of_the_printed_translation(mt, translator):
    answer = mt.post("/v1/attention", json={"text": "gato rojo grande", "beam": 2, "decimals": 4})
    assert answer.status_code == 200
    body = answer.json()
    offline = attention_maps(translator, "gato rojo grande", beam=2)
    translated = mt.post("/v1/translate", json={"texts": ["gato rojo grande"], "beam": 2}).json()
    assert body["translation"] == offline.translation == translated["translations"][0]["text"]
    assert body["source_tokens"] == offline.source_tokens
    assert body["target_outputs"] == offline.target_outputs
    assert body["layers"] == {"encoder": 2, "decoder": 2, "cross": 2} and body["heads"] == 4
    for kind in ("encoder", "decoder", "cross"):
        for layer in (1, 2):
            got = np.array(body["maps"][kind][str(layer)])
            want = getattr(offline, kind)[layer - 1].numpy()
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=5e-5)
    heads, queries, keys = np.array(body["maps"]["cross"]["1"]).shape
    assert (queries, keys) == (len(body["target_outputs"]), len(body["source_tokens"]))


def test_attention_maps_without_doubles_follow_the_request_then_the_server(translator):
    """no_doubles on /v1/attention gives the maps of /v1/translate's translation with the
    same setting; a request that does not say takes the server's (serve --no-doubles)."""
    doubled = [text for text in SENTENCES if translator.translate([text])
               != translator.translate([text], no_doubles=True)]
    assert doubled                           # the untrained model doubles some tokens
    text = doubled[0]
    for default in (False, True):
        with client_for(translator, max_chars=200, no_doubles=default) as client:
            for said in (None, False, True):
                body = {"text": text, "layers": [1]} | ({} if said is None else
                                                          {"no_doubles": said})
                maps = client.post("/v1/attention", json=body).json()
                expected = attention_maps(translator, text, no_doubles=default if said is None
                                          else said)
                assert maps["translation"] == expected.translation
                assert maps["target_outputs"] == expected.target_outputs


def test_attention_one_layer_and_kind_at_a_time(mt):
    answer = mt.post("/v1/attention", json={"text": "el perro", "kinds": ["cross"], "layers": [2],
                                            "decimals": 1})
    maps = answer.json()["maps"]
    assert list(maps) == ["cross"] and list(maps["cross"]) == ["2"]
    values = np.array(maps["cross"]["2"]).ravel()
    assert np.allclose(values, np.round(values, 1))


@pytest.mark.parametrize("body,status,field", [
    ({"text": ""}, 422, "text"),
    ({"text": "   "}, 422, "text"),
    ({"text": "uno", "layers": [3]}, 422, "layers[0]"),
    ({"text": "uno", "layers": [0]}, 422, "layers[0]"),
    ({"text": "uno", "kinds": ["self"]}, 422, "kinds[0]"),
    ({"text": "uno", "decimals": 9}, 422, "decimals"),
    ({"text": "uno " * 50}, 413, "text"),
    ({"text": "x" * 201}, 413, "text"),
    ({"texts": ["uno"]}, 422, "text"),
])
def test_attention_bad_requests(mt, body, status, field):
    answer = mt.post("/v1/attention", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field


@pytest.mark.parametrize("route,body,message", [
    ("/v1/translate", '{"texts": ["uno"], "alpha": NaN}', "alpha: NaN is not a number it takes"),
    ("/v1/translate", '{"texts": ["uno"], "alpha": -Infinity}', "alpha: -Infinity is not a number"),
    ("/v1/attention", '{"text": ""}', "text: String should have at least 1 character"),
])
def test_messages_say_what_is_wrong_with_the_value(mt, route, body, message):
    answer = mt.post(route, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 422 and answer.json()["error"].startswith(message)


def test_generate_refusals_from_its_options_name_the_field(lm):
    answer = lm.post("/v1/generate", json={"prompts": ["uno"], "beam": 2, "temperature": 0.5})
    assert answer.json()["error"].startswith("beam: beam search ranks whole continuations")
    answer = lm.post("/v1/generate", content='{"prompts": ["uno"], "temperature": NaN}',
                     headers={"content-type": "application/json"})
    assert answer.json() == {"error": "temperature: NaN is not a number it takes: give a "
                                      "finite number", "field": "temperature"}


def test_attention_layers_are_checked_before_translating(mt, monkeypatch):
    def no_translation(*args, **kwargs):
        raise AssertionError("the maps were computed")
    monkeypatch.setattr("transduce.serve.attention.attention_maps", no_translation)
    answer = mt.post("/v1/attention", json={"text": "uno " * 50, "layers": [1, 3]})
    assert answer.status_code == 422 and answer.json()["field"] == "layers[1]"


def test_attention_answers_are_streamed_in_pieces_that_make_the_same_json(mt, monkeypatch):
    whole = mt.post("/v1/attention", json={"text": "el perro come pan", "decimals": 5})
    assert whole.status_code == 200 and "content-length" not in whole.headers
    monkeypatch.setattr("transduce.serve.attention_answer.PIECE_VALUES", 1)    # a piece per row
    pieces = mt.post("/v1/attention", json={"text": "el perro come pan", "decimals": 5})
    assert pieces.json() == whole.json()
    assert len(pieces.content) == len(whole.content)


def test_attention_answers_over_max_attention_values_are_refused(translator):
    with client_for(translator) as client:
        everything = client.post("/v1/attention", json={"text": "el perro"}).json()
    count = sum(np.array(weights).size for layers in everything["maps"].values()
                for weights in layers.values())
    with client_for(translator, max_attention_values=count - 1) as client:
        refused = client.post("/v1/attention", json={"text": "el perro"})
        assert refused.status_code == 413
        assert refused.json()["error"].startswith(f"the maps asked for are {count} numbers, "
                                                  f"more than the limit of {count - 1}")
        one_layer = client.post("/v1/attention", json={"text": "el perro", "layers": [2]})
        assert one_layer.status_code == 200
        assert one_layer.json()["maps"]["cross"]["2"] == everything["maps"]["cross"]["2"]


def test_the_attention_cache_keeps_the_newest_maps_within_its_bytes():
    import torch

    from transduce.attention_maps import AttentionMaps
    from transduce.serve.attention_answer import MapsCache

    def maps(queries):       # 4 x queries x 8 float32 weights: 128 bytes per query
        return AttentionMaps([], [], [], "", 0.0, [], [], [torch.zeros(4, queries, 8)])

    cache = MapsCache(budget=1000)
    cache.put("a", maps(3))
    cache.put("b", maps(4))
    assert cache.get("a") is not None              # now the most recent of the two
    cache.put("c", maps(2))                        # 384 + 512 + 256 > 1000: b goes
    assert cache.get("b") is None and cache.get("a") and cache.get("c")
    cache.put("d", maps(10))                       # alone over the budget, and still kept
    assert list(cache.entries) == ["d"] and cache.bytes == 1280
    cache.put("d", maps(1))                        # put again: counted once
    assert cache.bytes == 128


def test_attention_truncates_when_asked(mt):
    answer = mt.post("/v1/attention", json={"text": "uno " * 50, "truncate": True,
                                            "layers": [1], "kinds": ["encoder"]})
    assert answer.status_code == 200 and len(answer.json()["source_tokens"]) == 40


# ------------------------------------------------------------------- the other kinds

@pytest.mark.parametrize("settings", [{}, {"beam": 2}, {"temperature": 0.8, "seed": 3},
                                      {"stop": ["4"], "repetition_penalty": 1.3},
                                      {"temperature": 0.8, "seed": 3, "frequency_penalty": 1.5,
                                       "presence_penalty": -1, "logit_bias": {"7": 20}},
                                      {"temperature": 1.3, "seed": 3, "min_p": 0.15}])
@pytest.mark.parametrize("continuous", [True, False])
def test_generate_equals_the_generator(generator, settings, continuous):
    """A running batch's or whole batches' (whose options are a batch's key) alike."""
    prompts = ["uno dos", "el perro grande come", "casa", ""]
    with client_for(generator, max_texts=16, continuous=continuous) as client:
        answer = client.post("/v1/generate",
                             json={"prompts": prompts, "max_new_tokens": 12, **settings})
    assert answer.status_code == 200, answer.text
    options = GenerateOptions(max_new_tokens=12, batch_sentences=16,
                              **{k: tuple(v) if k == "stop" else v for k, v in settings.items()})
    assert answer.json()["generations"] == generator.generate(prompts, options)


def test_sampled_requests_with_other_seeds_share_a_batch(generator, monkeypatch):
    """With whole batches (--static-batches), two sampled requests queued behind a
    running one are generated in one call, each prompt with its own seed: each answer is
    what the generator gives its request alone, and a prompt asked twice gets two
    samples."""
    calls, release = [], threading.Event()
    real = generator.generate_rows

    def recording(prompts, options, **settings):
        calls.append(list(prompts))
        if len(calls) == 1:
            release.wait(10)                       # holds the decoder while others queue
        return real(prompts, options, **settings)

    monkeypatch.setattr(generator, "generate_rows", recording)
    sampled = {"temperature": 0.9, "max_new_tokens": 8}
    bodies = [{"prompts": ["casa"]}, {"prompts": ["uno dos", "uno dos"], "seed": 5, **sampled},
              {"prompts": ["el perro"], "seed": 6, **sampled}]
    answers = [None] * 3
    with client_for(generator, max_texts=16, continuous=False) as client:
        def post(i):
            answers[i] = client.post("/v1/generate", json=bodies[i])

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        threads[0].start()
        deadline = time.monotonic() + 20
        while not calls:
            assert time.monotonic() < deadline, "the first request never reached the model"
            time.sleep(0.001)
        for thread in threads[1:]:
            thread.start()
        while client.get("/health").json()["queue_depth"] < 2:
            assert time.monotonic() < deadline, "the other requests were never queued"
            time.sleep(0.001)
        release.set()
        for thread in threads:
            thread.join(10)
    assert len(calls) == 2 and sorted(calls[1]) == ["el perro", "uno dos", "uno dos"]
    monkeypatch.setattr(generator, "generate_rows", real)
    for body, answer in zip(bodies[1:], answers[1:]):
        assert answer.json()["generations"] == generator.generate(body["prompts"],
                                                                  seed=body["seed"], **sampled)
    twice = answers[1].json()["generations"]
    assert twice[0] != twice[1]


def test_concurrent_generation_is_continuous_and_equals_each_alone(generator, monkeypatch):
    """Concurrent greedy, sampled and streamed requests (no beam) of different settings
    are generated in one continuous stream (one key), never by whole batches, and each
    gets what it gets alone."""
    real, submit, keys = generator.generate_rows, Batcher.submit, []

    def recorded(batcher, job):
        keys.append(job.key)
        return submit(batcher, job)

    def refused(*args, **kwargs):
        raise AssertionError("a whole batch where the requests stream continuously")

    sampled = {"temperature": 0.9, "top_k": 30}
    bodies = [{"prompts": [SENTENCES[i % len(SENTENCES)], SENTENCES[(3 * i) % len(SENTENCES)]],
               "max_new_tokens": 6 + 3 * i, **(sampled if i % 2 else {}), "seed": i,
               "stream": i % 3 == 2} for i in range(9)]
    answers = [None] * len(bodies)
    monkeypatch.setattr(generator, "generate_rows", refused)
    monkeypatch.setattr(Batcher, "submit", recorded)
    with client_for(generator, max_texts=16) as client:
        def post(i):
            if not bodies[i]["stream"]:
                answers[i] = client.post("/v1/generate", json=bodies[i]).json()["generations"]
                return
            with client.stream("POST", "/v1/generate", json=bodies[i]) as answer:
                events = "".join(answer.iter_text()).split("\n\n")
            pieces = [json.loads(e.removeprefix("data: ")) for e in events
                      if e.startswith("data: ")]
            answers[i] = ["".join(p["text"] for p in pieces if p["index"] == index)
                          for index in range(2)]

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    monkeypatch.setattr(generator, "generate_rows", real)
    for body, answer in zip(bodies, answers):
        settings = {k: v for k, v in body.items() if k not in ("prompts", "stream")}
        assert answer == generator.generate(body["prompts"], **settings), body
    assert len(keys) == len(bodies) and set(keys) == {("generate",)}


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "seed": 4}])
def test_streamed_pieces_join_to_the_whole_generation(lm, generator, settings):
    prompts = ["el perro grande come", "uno dos"]
    with lm.stream("POST", "/v1/generate", json={"prompts": prompts, "max_new_tokens": 16,
                                                 "stream": True, **settings}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = "".join(answer.iter_text())
    events = [block for block in text.split("\n\n") if block]
    assert events[-1].startswith("event: done")
    import json
    pieces = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    joined = ["".join(p["text"] for p in pieces if p["index"] == i) for i in range(2)]
    assert joined == generator.generate(prompts, max_new_tokens=16, **settings)


@pytest.mark.parametrize("body,status,field", [
    ({"prompts": ["uno"], "stream": True, "beam": 2}, 422, "stream"),
    ({"prompts": ["uno"], "top_p": 0}, 422, "top_p"),
    ({"prompts": ["uno"], "temperature": -1}, 422, "temperature"),
    ({"prompts": ["uno"], "stop": [""]}, 422, "stop[0]"),
    ({"prompts": ["uno", "uno " * 70]}, 413, "prompts[1]"),
    ({"prompts": ["uno"], "max_new_tokens": 0}, 422, "max_new_tokens"),
    ({"prompts": ["uno"], "beam": 2, "temperature": 0.5}, 422, "beam"),
])
def test_generate_bad_requests(lm, body, status, field):
    answer = lm.post("/v1/generate", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json().get("field") == field


def test_beam_with_temperature_is_refused_by_the_options(lm):
    answer = lm.post("/v1/generate", json={"prompts": ["uno"], "beam": 2, "temperature": 0.5})
    assert answer.status_code == 422 and "beam" in answer.json()["error"]


def test_embed_and_classify_equal_the_encoder(enc, encoder):
    texts = ["uno dos", "el perro grande come", "casa"]
    embedded = enc.post("/v1/embed", json={"texts": texts, "normalize": True}).json()
    np.testing.assert_allclose(embedded["embeddings"], encoder.embed(texts, normalize=True),
                               atol=1e-5)
    assert embedded["dimensions"] == encoder.model.config.d_model
    classified = enc.post("/v1/classify", json={"texts": texts}).json()["predictions"]
    assert [p["label"] for p in classified] == [p.label for p in encoder.classify(texts)]
    assert enc.post("/v1/classify", json={"texts": ["uno " * 40]}).status_code == 413
    cut = enc.post("/v1/embed", json={"texts": ["uno " * 40], "truncate": True}).json()
    assert cut["truncated"] == [True]


@pytest.mark.parametrize("setting", [{"top_p": 1e-300}, {"repetition_penalty": 1e-40}])
def test_sampling_settings_at_the_edge_of_float32_are_answered(lm, setting):
    answer = lm.post("/v1/generate", json={"prompts": ["uno"], "temperature": 1.0,
                                           "max_new_tokens": 3, **setting})
    assert answer.status_code == 200, answer.text


def test_the_routes_follow_the_model_kind(mt, lm, enc):
    assert mt.post("/v1/generate", json={"prompts": ["a"]}).status_code == 404
    assert lm.post("/v1/translate", json={"texts": ["a"]}).status_code == 404
    assert enc.post("/translate", json={"q": "a", "target": "en"}).status_code == 404
    assert mt.get("/v1/translate").status_code == 405
    assert mt.head("/health").status_code == 200
    missing = mt.get("/nothing/here")
    assert missing.status_code == 404 and missing.json()["error"].startswith("no route /nothing/")
    assert lm.post("/v1/translate", json={"texts": ["a"]}).json()["error"] == \
        "no route /v1/translate (this model's server answers POST on /v1/attention, " \
        "/v1/chat/completions, /v1/completions, /v1/generate)"
    paths = {client: set(client.get("/openapi.json").json()["paths"]) for client in (mt, lm, enc)}
    assert {"/v1/translate", "/translate", "/v1/attention", "/languages"} <= paths[mt]
    assert {"/v1/generate", "/v1/attention"} <= paths[lm] and "/v1/translate" not in paths[lm]
    assert {"/v1/embed", "/v1/classify", "/v1/attention"} <= paths[enc]


# ------------------------------------------------------------------- around the model

def test_health_models_and_docs(mt, enc, translator):
    assert mt.get("/health").json()["status"] == "ok"
    model = mt.get("/v1/models").json()["data"][0]
    assert model["kind"] == "translation" and model["languages"] == {"source": "es", "target": "en"}
    # The saved model's count, not the packed decoding copy's parameters.
    assert model["parameters"] == Transformer(translator.model.config).num_parameters()
    assert model["vocabulary"]["size"] == 300
    assert model["config"]["num_heads"] == 4 and model["limits"]["max_texts"] == 16
    assert model["attention_maps"] is True
    assert enc.get("/v1/models").json()["data"][0]["labels"] == ["animals", "numbers", "things"]
    assert mt.get("/docs").status_code == 200
    assert (model["engine"], model["dtype"], model["kv_dtype"]) == ("torch", "float32", None)


def test_what_is_served_and_how_is_said_in_one_line(translation_dir, lm_dir, encoder_dir):
    """The line the server logs as it starts (and /v1/models's types): the model, the
    type it decodes in (what --dtype auto chose), its KV caches', the batching."""
    from transduce import load
    from transduce.serve.app import create_app
    from transduce.serve.limits import Limits

    def said(model, **limits) -> str:
        return create_app(model, name="tiny", limits=Limits(**limits)).state.summary

    translator = load(translation_dir, kv_dtype="int4")
    parameters = f"{Transformer(translator.model.config).num_parameters():,} parameters"
    assert said(translator, decoders=2) == (
        f"Serving tiny: a translation model, {parameters}, decoding in float32 with int4 KV "
        f"caches; continuous batching, 2 decoders")
    assert said(translator, continuous=False).endswith("; dynamic batching")
    assert said(translator, batching=False).endswith("; no batching")
    generator = load(lm_dir, dtype="bfloat16")
    assert "a generation model" in said(generator) and \
        said(generator).endswith("decoding in bfloat16; continuous batching")
    with client_for(generator) as client:
        described = client.get("/v1/models").json()["data"][0]
    assert (described["dtype"], described["kv_dtype"]) == ("bfloat16", None)
    assert said(load(encoder_dir)).endswith("decoding in float32; dynamic batching")


def test_the_continuous_kernel_is_built_before_the_server_answers(translator, generator,
                                                                  monkeypatch):
    """A machine's first build of the one-query kernel (about 20 s) happens at start-up,
    not in the step of the first requests; only for a model that streams translations."""
    from transduce.attention import one_query

    calls = []
    monkeypatch.setattr(one_query, "available", lambda: calls.append("built") or True)
    with client_for(translator) as client:
        assert calls == ["built"]
        assert client.get("/health").status_code == 200
    for model, limits in [(generator, {}), (translator, {"continuous": False})]:
        with client_for(model, **limits):
            pass
    assert calls == ["built"]


def test_the_docs_page_loads_nothing_from_elsewhere(mt):
    """/docs names no other host: its script and styles are the server's, and Swagger
    UI's online validator is off."""
    html = mt.get("/docs").text
    assert "/openapi.json" in html and not re.search(r"(https?:)?//[\w.-]+\.\w", html)
    assert '"validatorUrl": null' in html and '"dom_id": "#swagger-ui"' in html
    for url in re.findall(r'(?:src|href)="([^"]+)"', html) + \
            re.findall(r"(?:url|href): '([^']+)'", html):
        answer = mt.get(url)
        assert answer.status_code == 200 and len(answer.content) > 1000, url
    assert mt.get("/redoc").status_code == 404     # ReDoc fetches its logo from a CDN
    assert mt.get("/docs-assets/swagger-ui-bundle.js").headers["content-type"].startswith(
        "text/javascript")
    missing = mt.get("/docs-assets/nothing.js")
    assert missing.status_code == 404 and "docs-assets/nothing.js" in missing.json()["error"]


def test_metrics_in_prometheus_text_format(mt):
    mt.post("/v1/translate", json={"texts": ["uno", "dos"], "beam": 1})
    mt.post("/v1/translate", json={"texts": []})
    mt.get("/no/such/page")
    text = mt.get("/metrics").text
    assert 'transduce_requests_total{route="/v1/translate",status="200"} 1' in text
    assert 'transduce_requests_total{route="/v1/translate",status="422"} 1' in text
    assert 'transduce_requests_total{route="unmatched",status="404"} 1' in text
    assert 'transduce_request_duration_seconds_count{route="/v1/translate"} 2' in text
    assert "transduce_sentences_total 2" in text and "transduce_queue_depth 0" in text
    assert "# TYPE transduce_batch_sentences histogram" in text
    assert "transduce_sentences_per_second" in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


def test_the_page_is_self_contained(mt, lm):
    page = mt.get("/")
    assert page.status_code == 200 and 'data-kind="translation"' in page.text
    assert 'data-kind="generation"' in lm.get("/").text
    remote = re.compile(r"""(src|href)=["']?(https?:)?//|url\(["']?(https?:)?//|"""
                        r"""fetch\(["'`](https?:)?//|import\s""")
    for asset in ("/static/app.js", "/static/style.css"):
        answer = mt.get(asset)
        assert answer.status_code == 200 and not remote.search(answer.text)
    assert not remote.search(page.text)
    assert mt.get("/static/secret.py").status_code == 404
    assert mt.get("/static/..%2Fapp.py").status_code == 404


def test_a_tiny_temperature_samples_what_greedy_search_chooses(lm, generator):
    # Found by the fuzz: logits / 1e-290 overflowed to inf - inf = nan, and a 500.
    answer = lm.post("/v1/generate", json={"prompts": ["uno dos"], "temperature": 2.8e-290,
                                           "seed": 1, "max_new_tokens": 10})
    assert answer.status_code == 200
    assert answer.json()["generations"] == generator.generate(["uno dos"], max_new_tokens=10)


def test_an_rnn_model_has_cross_attention_only(tiny_corpus):
    import torch

    from transduce.config import preset
    from transduce.data.tokenizer import Tokenizer
    from transduce.decode.translate import Translator
    from transduce.model import build_model

    torch.manual_seed(0)
    rnn = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40,
                             arch="rnn-luong"))
    with client_for(Translator(rnn, Tokenizer(tiny_corpus / "spm.model"))) as client:
        body = client.post("/v1/attention", json={"text": "el perro"}).json()
        assert body["layers"] == {"encoder": 0, "decoder": 0, "cross": 1} and body["heads"] == 1
        assert body["maps"]["encoder"] == {} and list(body["maps"]["cross"]) == ["1"]
        assert client.post("/v1/attention", json={"text": "el perro", "layers": [2]}
                           ).json()["field"] == "layers[0]"


def test_an_onnx_export_is_served_like_its_checkpoint(translation_dir, translator, tmp_path):
    """`transduce export onnx` output behind the server: /v1/translate and LibreTranslate's
    /translate answer as the checkpoint does (ONNX Runtime behind the same searches);
    /v1/attention is not offered (the graph returns no maps), which /v1/models says (the
    page then translates without the explorer)."""
    pytest.importorskip("onnxruntime")
    from transduce import load
    from transduce.export.onnx import export_onnx

    engine = load(export_onnx(translation_dir, tmp_path / "onnx"))
    with client_for(engine, max_chars=200, max_texts=16) as client:
        body = client.post("/v1/translate", json={"texts": SENTENCES, "beam": 3}).json()
        assert [t["text"] for t in body["translations"]] == translator.translate(SENTENCES, beam=3)
        libre = client.post("/translate", json={"q": SENTENCES[:2], "source": "es", "target": "en"})
        assert libre.json()["translatedText"] == translator.translate(SENTENCES[:2], beam=4)
        assert "/v1/attention" not in client.get("/openapi.json").json()["paths"]
        assert client.post("/v1/attention", json={"text": "el perro"}).status_code == 404
        described = client.get("/v1/models").json()["data"][0]
        assert described["attention_maps"] is False
        assert described["parameters"] == translator.model.num_parameters()


@pytest.mark.parametrize("argv", [["--languages", "es"], ["--languages", "es:en:fr"],
                                  ["--max-queue", "0"], ["--window-ms", "-1"],
                                  ["--window-ms", "5000"], ["--max-attention-values", "0"],
                                  ["--dtype", "float16"], ["--decoders", "0"]])
def test_the_command_refuses_bad_options(translation_dir, argv, capsys):
    from transduce.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(translation_dir), *argv])
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["language model", "translation"])
def test_the_command_serves_caches_of_the_kv_dtype_it_is_given(kind, lm_dir, translation_dir,
                                                               monkeypatch):
    """--kv-dtype reaches the model the server holds and the copies its decoder processes
    load; an encoder-only model, which keeps no cache, is refused by name."""
    import transduce.serve.server
    from transduce.cli import main

    served = {}
    monkeypatch.setattr(transduce.serve.server, "serve",
                        lambda model, **settings: served.update(model=model, **settings))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    directory = lm_dir if kind == "language model" else translation_dir
    assert main(["serve", "--model", str(directory), "--port", port, "--kv-dtype", "int4"]) == 0
    assert served["model"].cache_dtype == served["reload"]().cache_dtype == torch.int4
    assert main(["serve", "--model", str(directory), "--port", port]) == 0
    assert served["model"].cache_dtype is None


def test_an_encoder_is_served_without_a_kv_dtype(encoder_dir, lm_dir, capsys):
    """And --no-doubles is a translation model's (a language model's is refused too)."""
    from transduce.cli import main

    assert main(["serve", "--model", str(encoder_dir), "--kv-dtype", "int8"]) == 2
    assert "kv_dtype applies to models that decode" in capsys.readouterr().err
    assert main(["serve", "--model", str(lm_dir), "--no-doubles"]) == 2
    assert "--no-doubles applies to a translation model" in capsys.readouterr().err


def test_an_address_it_cannot_listen_on_is_refused_before_the_model_loads(tmp_path, capsys):
    from transduce.cli import main

    missing = str(tmp_path / "no-model")            # never read: the address fails first
    assert main(["serve", "--model", missing, "--host", "no-such-host.invalid"]) == 2
    assert "--host no-such-host.invalid: does not resolve" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model", missing, "--port", port]) == 2
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in capsys.readouterr().err


def test_more_threads_than_cpus_is_warned_about(monkeypatch):
    from transduce.cli.serve import _check_threads
    from transduce.errors import TransduceWarning

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.warns(TransduceWarning, match="--threads 3: more than the 2 CPUs"):
        _check_threads(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_threads(2)


def test_auto_decoders_run_streams_side_by_side_only_where_there_are_streams(translator,
                                                                            generator):
    """--decoders auto: two for a Transformer translating continuously on a CPU with two
    threads or more, one with batching or continuous decoding off and for other models."""
    from transduce.cli.serve import _auto_decoders
    from transduce.decode.parallel import intra_op_threads
    from transduce.serve.limits import Limits

    with intra_op_threads(2):
        assert _auto_decoders(translator, Limits()) == 2
        assert _auto_decoders(translator, Limits(batching=False)) == 1
        assert _auto_decoders(translator, Limits(continuous=False)) == 1
        assert _auto_decoders(generator, Limits()) == 1
    with intra_op_threads(1):
        assert _auto_decoders(translator, Limits()) == 1
    with pytest.raises(ConfigError, match="decoders"):
        Limits(decoders=0)
