"""SQuAD: the reader names what is wrong by file and item, the scores are SQuAD's own
(normalisation, exact match, token F1, unanswerable questions), and `evaluate` scores a
question answerer's best answers on a split with them."""

import json

import pytest

from transduce.cli import main
from transduce.data.corpus import CorpusError, corpus_kind
from transduce.data.squad import exact_match, f1, normalized, read_squad
from transduce.decode.encode import SentenceEncoder
from tests.encoder_heads import imported_head
from tests.test_import_bert import vocab  # noqa: F401 - a fixture

SQUAD = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
    {"context": "the quick brown fox jump over the lazy dog",
     "qas": [{"id": "q1", "question": "who jump", "answers": [
         {"text": "quick brown fox", "answer_start": 4}, {"text": "fox", "answer_start": 16}]},
             {"id": "q2", "question": "where", "answers": []}]},
    {"context": "hello world", "qas": [{"id": "q3", "question": "what", "answers": [
        {"text": "world", "answer_start": 6}]}]}]}]}


def test_scores_are_squads():
    assert normalized("The  Cat, an  apple!") == "cat apple"
    assert exact_match("the Cat.", ("cat",)) == 1.0 and exact_match("a cat", ("dog",)) == 0.0
    assert f1("big black cat", ("black cat sat",)) == pytest.approx(2 / 3)
    assert f1("black cat", ("dog", "black cat")) == 1.0
    assert f1("the", ("a",)) == 1.0               # both normalise to nothing
    assert f1("cat cat", ("cat cat dog",)) == pytest.approx(0.8)   # tokens counted
    assert exact_match("", ()) == 1.0 and f1("fox", ()) == 0.0      # unanswerable
    assert f1("", ()) == 1.0 and exact_match(" the ", ()) == 1.0


def test_the_reader_takes_squad_and_names_what_is_wrong(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(SQUAD), encoding="utf-8")
    questions = read_squad(path)
    assert [q.id for q in questions] == ["q1", "q2", "q3"]
    assert questions[0].answers == ("quick brown fox", "fox") and questions[1].answers == ()
    assert questions[2].context == "hello world"
    assert corpus_kind(tmp_path) == "qa"
    for values, message in (
            ([], 'expected an object with a "data" list'),
            ({"data": [{"paragraphs": [{"context": 3, "qas": []}]}]},
             "data[0].paragraphs[0].context: expected a string"),
            ({"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q"}]}]}]},
             "data[0].paragraphs[0].qas[0].answers: expected a list"),
            ({"data": []}, "no question")):
        path.write_text(json.dumps(values), encoding="utf-8")
        with pytest.raises(CorpusError, match=message.replace("[", r"\[").replace("]", r"\]")):
            read_squad(path)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(CorpusError, match="dev.json: not SQuAD's JSON"):
        read_squad(path)


def test_evaluate_scores_a_question_answerer(vocab, tmp_path, capsys):  # noqa: F811
    *_, out = imported_head("bert", "QuestionAnswering", tmp_path, vocab / "uncased" / "json",
                            24)
    data = tmp_path / "squad"
    data.mkdir()
    (data / "dev.json").write_text(json.dumps(SQUAD), encoding="utf-8")
    assert main(["evaluate", "--model", str(out), "--data", str(data), "--split", "dev"]) == 0
    printed = capsys.readouterr().out
    assert "dev: exact match" in printed and "3 questions, 1 without an answer" in printed
    assert "; has answer: exact match" in printed and "; no answer: exact match" in printed
    questions = read_squad(data / "dev.json")
    found = SentenceEncoder.load(out).answer([q.question for q in questions],
                                             [q.context for q in questions], no_answer=True)
    texts = [answers[0].text for answers in found]
    result = json.loads((out / "eval-dev-answer.json").read_text())
    assert result["questions"] == 3 and result["unanswerable"] == 1 and result["abstains"]
    for name, answerable in (("has_answer", True), ("no_answer", False)):
        kept = [(t, q) for t, q in zip(texts, questions) if bool(q.answers) == answerable]
        assert result[name]["questions"] == len(kept)
        assert result[name]["exact_match"] == pytest.approx(
            sum(exact_match(t, q.answers) for t, q in kept) / len(kept))
    assert result["exact_match"] == pytest.approx(
        sum(exact_match(t, q.answers) for t, q in zip(texts, questions)) / 3)
    assert result["f1"] == pytest.approx(sum(f1(t, q.answers)
                                             for t, q in zip(texts, questions)) / 3)
    assert json.loads((out / "eval-dev-answer.answers.json").read_text()) == \
        {q.id: t for q, t in zip(questions, texts)}
