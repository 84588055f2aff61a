"""/v1/embeddings: OpenAI's shape over the encoder's own vectors (texts as [CLS] text
[SEP], token ids as they are; floats or base64 of the same float32 values), usage that
counts the tokens read, 4xx in OpenAI's shape naming the input, and OpenAI's client
reading all of it."""

import base64

import numpy as np
import pytest

from tests.serve.test_server import ServerThread
from transduce.decode.inputs import PromptIds
from transduce.serve.app import create_app

TEXTS = ["uno dos", "el perro grande come", "", "casa"]


def vectors(answer) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    assert {item["object"] for item in body["data"]} == {"embedding"}
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float32)


def test_texts_and_a_text_are_the_encoders_vectors_with_their_usage(enc, encoder):
    answer = enc.post("/v1/embeddings", json={"input": TEXTS, "model": "anything"})
    np.testing.assert_allclose(vectors(answer), encoder.embed(TEXTS), atol=1e-6, rtol=0)
    body = answer.json()
    tokens = sum(map(len, encoder.item_ids(TEXTS)))     # [CLS] and [SEP] counted
    assert (body["object"], body["model"]) == ("list", "tiny")
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    one = enc.post("/v1/embeddings", json={"input": TEXTS[1]})
    np.testing.assert_allclose(vectors(one)[0], encoder.embed(TEXTS[1:2])[0], atol=1e-6,
                               rtol=0)


def test_token_ids_are_read_as_they_are(enc, encoder):
    items = encoder.item_ids(TEXTS)
    np.testing.assert_allclose(vectors(enc.post("/v1/embeddings", json={"input": items})),
                               encoder.embed(TEXTS), atol=1e-6, rtol=0)
    bare = items[1][1:-1]                              # no [CLS] or [SEP]
    np.testing.assert_allclose(vectors(enc.post("/v1/embeddings", json={"input": bare}))[0],
                               encoder.embed([PromptIds(bare)])[0], atol=1e-6, rtol=0)
    answer = enc.post("/v1/embeddings", json={"input": bare}).json()
    assert answer["usage"]["prompt_tokens"] == len(bare)


def test_base64_carries_the_same_float32_values(enc):
    floats = vectors(enc.post("/v1/embeddings", json={"input": TEXTS}))
    packed = enc.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
    assert packed.status_code == 200, packed.text
    decoded = np.array([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
                        for item in packed.json()["data"]])
    np.testing.assert_array_equal(decoded, floats)
    width = floats.shape[1]
    assert enc.post("/v1/embeddings", json={"input": "uno", "dimensions": width}
                    ).status_code == 200


@pytest.mark.parametrize("body,status,field,words", [
    ({"input": ["uno", "uno " * 40]}, 413, "input[1]", "positions the model reads"),
    ({"input": "uno " * 40}, 413, "input", "42 tokens, more than the 32 positions"),
    ({"input": [[5] * 33]}, 413, "input[0]", "33 tokens"),
    ({"input": [[5, 6], [5, 300]]}, 422, "input[1]", "token 1 is 300, not an id"),
    ({"input": ["a"] * 17}, 413, "input", "17 inputs, more than the limit of 16"),
    ({"input": [[1]] * 17}, 413, "input", "17 inputs"),
    ({"input": "a" * 201}, 413, "input", "201 characters"),
    ({"input": []}, 422, "input", "give a text, a list of texts, token ids"),
    ({"input": [[1], "a"]}, 422, "input", "item [1] is \"a\""),
    ({"input": [1, -2]}, 422, "input", "item [1] is -2, no token id"),
    ({"input": "uno", "dimensions": 8}, 422, "dimensions", "not trained for shorter"),
    ({"input": "uno", "encoding_format": "int8"}, 422, "encoding_format", "float"),
    ({"input": "uno", "truncate": True}, 422, "truncate", "unknown field"),
    ({}, 422, "input", "required"),
])
def test_bad_requests_are_named_in_openais_shape(enc, body, status, field, words):
    answer = enc.post("/v1/embeddings", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_only_an_encoder_serves_embeddings_and_refusals_are_documented_as_openais(lm, enc):
    assert lm.post("/v1/embeddings", json={"input": "uno"}).status_code == 404
    paths = enc.get("/openapi.json").json()["paths"]
    for path, body in (("/v1/embeddings", "/OpenAIErrorBody"), ("/v1/embed", "/ErrorBody")):
        schema = paths[path]["post"]["responses"]["413"]["content"]["application/json"]
        assert schema["schema"]["$ref"].endswith(body)


def test_openais_client_reads_floats_and_base64(encoder):
    openai = pytest.importorskip("openai")
    with ServerThread(create_app(encoder, name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        expected = encoder.embed(TEXTS)
        default = client.embeddings.create(model="tiny", input=TEXTS)   # asks for base64
        assert np.array([d.embedding for d in default.data], dtype=np.float32).tobytes() == \
            vectors_of(client, "float").tobytes()
        np.testing.assert_allclose([d.embedding for d in default.data], expected, atol=1e-6,
                                   rtol=0)
        assert default.usage.prompt_tokens == sum(map(len, encoder.item_ids(TEXTS)))
        with pytest.raises(openai.UnprocessableEntityError, match="not trained for shorter"):
            client.embeddings.create(model="tiny", input=TEXTS, dimensions=4)


def vectors_of(client, encoding_format: str) -> np.ndarray:
    answer = client.embeddings.create(model="tiny", input=TEXTS,
                                      encoding_format=encoding_format)
    return np.array([d.embedding for d in answer.data], dtype=np.float32)
