"""/v1/answer: a question answerer's answers (spans of each question's context) as the
library gives them, long contexts read in windows, /v1/models saying so, the other heads'
routes absent, and bad requests answered 4xx naming the field."""

from tests.serve.conftest import SENTENCES

QUESTIONS = ["el perro", "uno", "casa"]
CONTEXTS = [" ".join(SENTENCES), SENTENCES[0], ""]


def test_answers_are_the_librarys(asks, answerer):
    answer = asks.post("/v1/answer", json={"questions": QUESTIONS, "contexts": CONTEXTS,
                                           "top_k": 2, "max_answer_tokens": 5})
    assert answer.status_code == 200, answer.text
    expected = answerer.answer(QUESTIONS, CONTEXTS, top_k=2, max_answer_pieces=5)
    assert answer.json()["answers"] == [[vars(a) for a in answers] for answers in expected]
    assert len(expected[0]) == 2 and expected[2] == []
    for context, answers in zip(CONTEXTS, expected):
        for found in answers:
            assert context[found.start:found.end] == found.text


def test_the_empty_answer_competes_when_asked(asks, answerer):
    body = {"questions": QUESTIONS[:2], "contexts": CONTEXTS[:2], "top_k": 20,
            "no_answer": True}
    answer = asks.post("/v1/answer", json=body)
    assert answer.status_code == 200, answer.text
    expected = answerer.answer(QUESTIONS[:2], CONTEXTS[:2], top_k=20, no_answer=True)
    assert answer.json()["answers"] == [[vars(a) for a in answers] for answers in expected]
    assert all(sum(a.text == "" for a in answers) == 1 for answers in expected)
    plain = asks.post("/v1/answer", json={**body, "no_answer": False}).json()["answers"]
    assert all(a["text"] for answers in plain for a in answers)


def test_models_says_it_answers_and_the_other_routes_are_absent(asks, enc):
    info = asks.get("/v1/models").json()["data"][0]
    assert info["answers"] is True and info["classifies"] is False and info["tags"] is False
    assert asks.post("/v1/classify", json={"texts": ["el perro"]}).status_code == 404
    assert asks.post("/v1/tag", json={"texts": ["el perro"]}).status_code == 404
    assert enc.post("/v1/answer", json={"questions": ["a"], "contexts": ["b"]}).status_code \
        == 404


def test_bad_requests_are_named(asks):
    for body, field in (({"questions": ["a", "b"], "contexts": ["c"]}, "contexts"),
                        ({"questions": ["a"]}, "contexts"),
                        ({"questions": ["a"], "contexts": ["c"], "top_k": 0}, "top_k"),
                        ({"questions": ["a"], "contexts": ["x" * 201]}, "contexts"),
                        ({"questions": "a", "contexts": ["c"]}, "questions"),
                        ({"questions": ["a"], "contexts": ["c"], "no_answer": "yes"},
                         "no_answer")):
        answer = asks.post("/v1/answer", json=body)
        assert 400 <= answer.status_code < 500, (body, answer.text)
        assert field in answer.text
