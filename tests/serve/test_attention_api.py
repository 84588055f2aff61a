"""POST /v1/attention of an encoder-only model (its pass over a text or a pair) and of a
language model (its greedy continuation of a prompt): the maps of attention_maps.py,
the pieces on their axes, the limits, the refusals. A translation's: test_api.py."""

import numpy as np
import pytest

from tests.serve.conftest import client_for
from transduce.attention_maps import encoder_attention_maps, generation_attention_maps
from transduce.serve.encoding import token_counts


def assert_maps_equal(answer: dict, kind: str, recorded: list) -> None:
    """Every layer's (H, T, S) weights in the answer, against the library's."""
    assert list(answer["maps"]) == [kind]
    assert list(answer["maps"][kind]) == [str(n) for n in range(1, len(recorded) + 1)]
    for layer, weights in enumerate(recorded, start=1):
        got = np.array(answer["maps"][kind][str(layer)])
        assert got.shape == tuple(weights.shape)
        np.testing.assert_allclose(got, weights.numpy(), atol=5e-5)


@pytest.mark.parametrize("pair", [None, "el gato rojo"])
def test_an_encoders_maps_are_those_of_its_pass_over_the_text(enc, encoder, pair):
    body = {"text": "uno dos tres casa", "decimals": 4} | ({} if pair is None else
                                                         {"text_pair": pair})
    answer = enc.post("/v1/attention", json=body)
    assert answer.status_code == 200, answer.text
    found = answer.json()
    offline = encoder_attention_maps(encoder, "uno dos tres casa", pair)
    assert found["tokens"] == offline.source_tokens
    assert found["text"] == ("uno dos tres casa" if pair is None else
                             "uno dos tres casa | el gato rojo")
    assert found["layers"] == {"encoder": 2} and found["heads"] == 4
    assert_maps_equal(found, "encoder", offline.encoder)
    separators = found["tokens"].count(found["tokens"][-1])
    assert separators == (1 if pair is None else 2)          # [SEP], or a pair's two


def test_a_language_models_maps_are_those_of_its_greedy_continuation(lm, generator):
    answer = lm.post("/v1/attention", json={"prompt": "uno dos", "max_new_tokens": 6,
                                            "decimals": 5})
    assert answer.status_code == 200, answer.text
    found = answer.json()
    offline = generation_attention_maps(generator, "uno dos", max_new_tokens=6)
    assert found["continuation"] == generator.generate(["uno dos"], max_new_tokens=6)[0]
    assert found["prompt"] + found["continuation"] == offline.translation
    assert found["log_prob"] == pytest.approx(offline.log_prob, abs=1e-5)
    assert (found["inputs"], found["outputs"]) == (offline.target_inputs,
                                                   offline.target_outputs)
    assert found["inputs"][1:] == found["outputs"][:-1]        # each position's next piece
    assert found["layers"] == {"decoder": 2}
    assert_maps_equal(found, "decoder", offline.decoder)
    weights = np.array(found["maps"]["decoder"]["1"])
    assert np.all(np.triu(weights, k=1) == 0)                  # nothing after a position


def test_one_layer_at_a_time_is_computed_once(lm, generator, monkeypatch):
    """The page asks for one layer at a time: the continuation is generated once."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return generation_attention_maps(*args, **kwargs)

    monkeypatch.setattr("transduce.serve.attention.generation_attention_maps", counted)
    first = lm.post("/v1/attention", json={"prompt": "el perro", "max_new_tokens": 4,
                                           "layers": [1]}).json()
    second = lm.post("/v1/attention", json={"prompt": "el perro", "max_new_tokens": 4,
                                            "layers": [2]}).json()
    assert len(calls) == 1
    assert list(first["maps"]["decoder"]) == ["1"] and list(second["maps"]["decoder"]) == ["2"]
    assert first["continuation"] == second["continuation"]


def test_a_continuation_stops_at_the_models_positions(generator):
    prompt = " ".join(["uno"] * 60)
    length = len(generator.encode([prompt])[0])
    assert generator.context - 10 < length < generator.context
    with client_for(generator) as client:
        found = client.post("/v1/attention", json={"prompt": prompt, "max_new_tokens": 50,
                                                   "layers": [1]}).json()
    assert len(found["inputs"]) == len(found["outputs"]) == generator.context - 1
    weights = np.array(found["maps"]["decoder"]["1"])
    assert weights.shape[1:] == (generator.context - 1,) * 2


def test_rollouts_of_every_shape_are_the_librarys(mt, translator, enc, encoder, lm,
                                                 generator):
    """"rollout": one map a layer, AttentionMaps.rollout's; a translation's without
    cross-attention unless asked for it (422), its raw maps still served."""
    from transduce.attention_maps import attention_maps

    cases = ((mt, {"text": "el perro"}, attention_maps(translator, "el perro"), "translation"),
             (enc, {"text": "el perro"}, encoder_attention_maps(encoder, "el perro"), "text"),
             (lm, {"prompt": "el perro", "max_new_tokens": 4},
              generation_attention_maps(generator, "el perro", max_new_tokens=4), "prompt"))
    for client, body, offline, _ in cases:
        answer = client.post("/v1/attention", json=body | {"rollout": True, "decimals": 5})
        assert answer.status_code == 200, answer.text
        found, rolled = answer.json(), offline.rollout()
        assert found["heads"] == 1
        kinds = [kind for kind in ("encoder", "decoder") if getattr(rolled, kind)]
        assert list(found["maps"]) == kinds
        for kind in kinds:
            for layer, weights in enumerate(getattr(rolled, kind), start=1):
                np.testing.assert_allclose(found["maps"][kind][str(layer)], weights.numpy(),
                                           atol=5e-5)
    raw = mt.post("/v1/attention", json={"text": "el perro", "layers": [1]}).json()
    assert raw["heads"] == 4 and "cross" in raw["maps"]
    refused = mt.post("/v1/attention", json={"text": "el perro", "rollout": True,
                                             "kinds": ["cross"]})
    assert refused.status_code == 422 and refused.json()["field"] == "kinds"


def test_a_model_without_self_attention_has_no_rollout(tiny_corpus, tmp_path):
    from transduce import checkpoint, load
    from transduce.config import preset
    from transduce.data.tokenizer import MODEL_NAME
    from transduce.model import build_model

    model = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300,
                               max_positions=40, arch="rnn-luong"))
    checkpoint.save(tmp_path / "rnn", model, None, tiny_corpus / MODEL_NAME)
    with client_for(load(tmp_path / "rnn")) as client:
        answer = client.post("/v1/attention", json={"text": "el perro", "rollout": True})
    assert answer.status_code == 422 and answer.json()["field"] == "rollout"
    assert "no self-attention layers" in answer.json()["error"]


@pytest.mark.parametrize("body,status,field", [
    ({"text": ""}, 422, "text"),
    ({"text": "  "}, 422, "text"),
    ({"text": "uno", "text_pair": " "}, 422, "text_pair"),
    ({"text": "uno", "layers": [3]}, 422, "layers[0]"),
    ({"text": "uno", "kinds": ["encoder"]}, 422, "kinds"),
    ({"text": "uno " * 40}, 413, "text"),
    ({"text": "uno " * 20, "text_pair": "dos " * 20}, 413, "text_pair"),
    ({"text": "x" * 201}, 413, "text"),
    ({"text": "uno", "text_pair": "x" * 201}, 413, "text_pair"),
    ({"prompt": "uno"}, 422, "text"),
])
def test_an_encoders_bad_requests(enc, body, status, field):
    answer = enc.post("/v1/attention", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field


@pytest.mark.parametrize("body,status,field", [
    ({"prompt": "uno", "max_new_tokens": 0}, 422, "max_new_tokens"),
    ({"prompt": "uno", "layers": [0]}, 422, "layers[0]"),
    ({"prompt": "uno", "layers": [5]}, 422, "layers[0]"),
    ({"prompt": "uno", "beam": 2}, 422, "beam"),
    ({"prompt": "uno " * 70}, 413, "prompt"),
    ({"prompt": "x" * 201}, 413, "prompt"),
    ({"text": "uno"}, 422, "prompt"),
])
def test_a_language_models_bad_requests(lm, body, status, field):
    answer = lm.post("/v1/attention", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field


def test_a_pair_fits_the_models_positions_with_its_three_markers(enc, encoder):
    """[CLS] text [SEP] second [SEP]: a pair of max_positions - 3 tokens is read whole,
    one of a token more is refused."""
    room = encoder.model.config.max_positions - 3
    first = " ".join(["uno"] * 10)
    second = " ".join(["uno"] * (room - token_counts(encoder, [first])[0]))
    fits = enc.post("/v1/attention", json={"text": first, "text_pair": second, "layers": [1]})
    assert len(fits.json()["tokens"]) == room + 3
    over = enc.post("/v1/attention", json={"text": first, "text_pair": second + " uno",
                                           "layers": [1]})
    assert over.status_code == 413, over.text
    assert over.json()["error"].startswith(f"text and text_pair: {room + 1} tokens together, "
                                           f"more than the model's limit of {room} for a pair")


def test_an_encoder_truncates_when_asked(enc):
    answer = enc.post("/v1/attention", json={"text": "uno " * 40, "truncate": True,
                                             "layers": [1]})
    assert answer.status_code == 200 and len(answer.json()["tokens"]) == 32


def test_maps_over_max_attention_values_are_refused_for_every_shape(encoder, generator):
    for model, body, kind in ((encoder, {"text": "el perro"}, "encoder"),
                              (generator, {"prompt": "el perro", "max_new_tokens": 3},
                               "decoder")):
        with client_for(model) as client:
            everything = client.post("/v1/attention", json=body).json()
        count = sum(np.array(w).size for w in everything["maps"][kind].values())
        with client_for(model, max_attention_values=count - 1) as client:
            refused = client.post("/v1/attention", json=body)
            assert refused.status_code == 413 and refused.json()["field"] == "layers"
            one = client.post("/v1/attention", json=body | {"layers": [2]})
            assert one.json()["maps"][kind]["2"] == everything["maps"][kind]["2"]


def test_every_shape_says_it_serves_maps(enc, lm):
    for client in (enc, lm):
        assert client.get("/v1/models").json()["data"][0]["attention_maps"] is True
