"""/v1/tag: a token classifier's tags of each word and the entities they mark, as the
library gives them (long texts in chunks), /v1/models saying so, the other heads' routes
absent, and bad requests answered 4xx naming the field."""

from tests.serve.conftest import SENTENCES, TAGS
from transduce.decode.tagging import entities

TEXTS = [SENTENCES[2] + " " + SENTENCES[4], "el perro", "   ", "casa"]


def test_tags_and_entities_are_the_librarys(tags, tagger):
    answer = tags.post("/v1/tag", json={"texts": TEXTS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = tagger.tag(TEXTS)
    assert len(TEXTS[0].split()) > tagger.model.config.max_positions   # in chunks
    assert body["words"] == [[{"word": w.word, "tag": w.tag, "probability": w.probability}
                              for w in line] for line in expected]
    assert body["entities"] == [[vars(e) for e in entities([w.word for w in line],
                                                          [w.tag for w in line])]
                                for line in expected]
    assert body["words"][2] == [] and {w["tag"] for line in body["words"] for w in line} \
        <= set(TAGS)
    assert any(body["entities"])


def test_models_says_it_tags_and_the_other_routes_are_absent(tags, enc):
    info = tags.get("/v1/models").json()["data"][0]
    assert info["tags"] is True and info["classifies"] is False and info["labels"] == TAGS
    assert tags.post("/v1/classify", json={"texts": ["el perro"]}).status_code == 404
    assert enc.post("/v1/tag", json={"texts": ["el perro"]}).status_code == 404
    assert enc.get("/v1/models").json()["data"][0]["tags"] is False


def test_bad_requests_are_named(tags):
    for body, field in (({"texts": "el perro"}, "texts"), ({}, "texts"),
                        ({"texts": ["x"] * 17}, "texts"), ({"texts": ["x" * 201]}, "texts"),
                        ({"texts": ["x"], "truncate": True}, "truncate")):
        answer = tags.post("/v1/tag", json=body)
        assert 400 <= answer.status_code < 500, (body, answer.text)
        assert field in answer.text
