"""/v1/rerank: Cohere's and Jina's shape over the library's ranking (the same order and
relevance, documents as texts or objects, top_n, return_documents), the pairs of
concurrent requests in one batch, usage counting what the model read, 4xx naming the
field; offered by a cross-encoder only, whose /v1/classify is not."""

import threading

import numpy as np
import pytest

from transduce.decode.encode import SentenceEncoder

QUERY = "el perro grande"
DOCUMENTS = ["uno dos tres", "el perro come", "gato rojo", "", "el perro grande come el gato"]


def results(answer) -> list[dict]:
    assert answer.status_code == 200, answer.text
    return answer.json()["results"]


def test_the_ranking_is_the_librarys(ranks, reranker):
    expected = reranker.rerank(QUERY, DOCUMENTS)
    found = results(ranks.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                   "model": "anything"}))
    assert [r["index"] for r in found] == [r.index for r in expected]
    np.testing.assert_allclose([r["relevance_score"] for r in found],
                               [r.relevance for r in expected], rtol=1e-6)
    assert [r["document"]["text"] for r in found] == [DOCUMENTS[r.index] for r in expected]
    scores = reranker.score([QUERY] * len(DOCUMENTS), pairs=DOCUMENTS, warn=False)
    assert [r["index"] for r in found] == list(np.argsort(-scores, kind="stable"))


def test_top_n_objects_and_no_documents(ranks, reranker):
    expected = reranker.rerank(QUERY, DOCUMENTS, top_n=2)
    found = results(ranks.post("/v1/rerank", json={
        "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2,
        "return_documents": False}))
    assert [(r["index"], r["document"]) for r in found] == [(r.index, None) for r in expected]
    again = results(ranks.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                   "top_n": 9}))     # more than there are
    assert [r["index"] for r in again] == [r.index for r in reranker.rerank(QUERY, DOCUMENTS)]


def test_usage_counts_each_pair_as_the_model_reads_it(ranks, reranker):
    body = ranks.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
    t = reranker.tokenizer
    (query,) = t.encode([QUERY])
    limit = reranker.model.config.max_positions         # [CLS] query [SEP] document [SEP]:
    expected = sum(min(len(query) + len(d) + 3, limit) for d in t.encode(DOCUMENTS))
    assert expected < sum(len(query) + len(d) + 3 for d in t.encode(DOCUMENTS))   # one cut
    assert body["usage"] == {"total_tokens": expected}
    long = ranks.post("/v1/rerank", json={"query": QUERY, "documents": ["uno " * 40]}).json()
    assert long["usage"]["total_tokens"] == limit


def test_concurrent_requests_are_ranked_as_alone(ranks, reranker):
    queries = ["uno", "el gato", "casa rojo", "perro"]
    answers = {}

    def ask(query):
        answers[query] = results(ranks.post("/v1/rerank", json={"query": query,
                                                                "documents": DOCUMENTS}))
    threads = [threading.Thread(target=ask, args=(q,)) for q in queries]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for query in queries:
        alone = reranker.rerank(query, DOCUMENTS)
        assert [r["index"] for r in answers[query]] == [r.index for r in alone]
        np.testing.assert_allclose([r["relevance_score"] for r in answers[query]],
                                   [r.relevance for r in alone], atol=1e-6)


@pytest.mark.parametrize("body,status,field,words", [
    ({"query": QUERY, "documents": []}, 422, "documents", "at least 1"),
    ({"query": QUERY, "documents": ["a"] * 17}, 413, "documents", "17 texts"),
    ({"query": QUERY, "documents": ["a", "b" * 201]}, 413, "documents[1]", "201 characters"),
    ({"query": "q" * 201, "documents": ["a"]}, 413, "query", "201 characters"),
    ({"query": QUERY, "documents": ["a"], "top_n": 0}, 422, "top_n", "greater than or equal"),
    ({"query": QUERY, "documents": [{"txt": "a"}]}, 422, "documents[0].text", "required"),
    ({"query": QUERY, "documents": [5]}, 422, "documents[0]", ""),
    ({"documents": ["a"]}, 422, "query", "required"),
    ({"query": QUERY, "documents": ["a"], "rank_fields": ["x"]}, 422, "rank_fields",
     "unknown field"),
])
def test_bad_requests_are_named(ranks, body, status, field, words):
    answer = ranks.post("/v1/rerank", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field and words in answer.json()["error"]


def test_only_a_cross_encoder_reranks_and_it_does_not_classify(ranks, enc, reranker):
    assert enc.post("/v1/rerank", json={"query": "a", "documents": ["b"]}).status_code == 404
    assert ranks.post("/v1/classify", json={"texts": ["a"]}).status_code == 404
    described = [c.get("/v1/models").json()["data"][0] for c in (ranks, enc)]
    assert [(d["reranks"], d["classifies"]) for d in described] == [(True, False),
                                                                    (False, True)]
    assert "/v1/rerank" in ranks.get("/openapi.json").json()["paths"]
    assert isinstance(reranker, SentenceEncoder) and reranker.scores
