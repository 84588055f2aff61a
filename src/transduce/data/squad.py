"""Questions with their contexts and answers, in SQuAD's JSON (Rajpurkar et al. 2016, 2018):
{split}.json = {"data": [{"paragraphs": [{"context": ..., "qas": [{"id": ..., "question":
..., "answers": [{"text": ..., "answer_start": ...}], "is_impossible": ...}]}]}]}, as
the SQuAD 1.1 and 2.0 files hold them. A question-answering corpus is a directory of
such files and corpus.json with "kind": "qa". Errors name the file and the item.

The scores are SQuAD's own: an answer and each gold answer are normalised (lowercased,
punctuation, the articles a, an, the and extra whitespace removed); exact match is 1 when
the answer equals one of them, F1 the best harmonic mean of its tokens' precision and
recall against one. A question of no gold answer (SQuAD 2.0's unanswerable) scores 1 for
an empty answer, 0 for any other.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from transduce.data.corpus import CorpusError

QA_SUFFIX = ".json"


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    context: str
    answers: tuple[str, ...]     # the gold answers' texts (none: unanswerable)
    answer_starts: tuple[int | None, ...] = ()   # each one's first character in the
                                                 # context (None: the file gives none)


def qa_file(data_dir: Path | str, split: str) -> Path:
    return Path(data_dir) / f"{split}{QA_SUFFIX}"


def read_squad(path: Path | str) -> list[Question]:
    """The questions of a SQuAD JSON file, in its order."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorpusError(f"{path}: not SQuAD's JSON ({error})") from None
    if not isinstance(values, dict) or not isinstance(values.get("data"), list):
        raise CorpusError(f"{path}: expected an object with a \"data\" list (SQuAD's JSON)")
    questions = []
    for article_index, article in enumerate(values["data"]):
        for paragraph_index, paragraph in enumerate(_list(article, "paragraphs", path,
                                                          f"data[{article_index}]")):
            where = f"data[{article_index}].paragraphs[{paragraph_index}]"
            context = _text(paragraph, "context", path, where)
            for index, item in enumerate(_list(paragraph, "qas", path, where)):
                at = f"{where}.qas[{index}]"
                given = _list(item, "answers", path, at)
                answers = tuple(_text(answer, "text", path, f"{at}.answers[{n}]")
                                for n, answer in enumerate(given))
                starts = tuple(_start(answer, path, f"{at}.answers[{n}]")
                               for n, answer in enumerate(given))
                questions.append(Question(str(item.get("id", at)),
                                          _text(item, "question", path, at), context,
                                          answers, starts))
    if not questions:
        raise CorpusError(f"{path}: no question")
    return questions


def _list(item, key: str, path: Path, where: str) -> list:
    value = item.get(key) if isinstance(item, dict) else None
    if not isinstance(value, list):
        raise CorpusError(f"{path}: {where}.{key}: expected a list")
    return value


def _text(item, key: str, path: Path, where: str) -> str:
    value = item.get(key) if isinstance(item, dict) else None
    if not isinstance(value, str):
        raise CorpusError(f"{path}: {where}.{key}: expected a string")
    return value


def _start(answer: dict, path: Path, where: str) -> int | None:
    """An answer's answer_start: None when absent (scoring needs none; training does)."""
    value = answer.get("answer_start")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CorpusError(f"{path}: {where}.answer_start: expected a character offset "
                          f"(an integer >= 0), got {value!r}")
    return value


def normalized(text: str) -> str:
    """SQuAD's normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(answer: str, gold: tuple[str, ...]) -> float:
    if not gold:
        return float(not normalized(answer))
    return float(any(normalized(answer) == normalized(g) for g in gold))


def f1(answer: str, gold: tuple[str, ...]) -> float:
    if not gold:
        return float(not normalized(answer))
    return max(_token_f1(normalized(answer).split(), normalized(g).split()) for g in gold)


def squad_scores(texts: list[str], questions: list[Question]) -> dict[str, float]:
    """The mean exact match and F1 of answer texts[i] to questions[i]."""
    if len(texts) != len(questions) or not texts:
        raise ValueError(f"{len(texts)} answers to {len(questions)} questions")
    pairs = list(zip(texts, questions))
    return {"exact_match": sum(exact_match(t, q.answers) for t, q in pairs) / len(pairs),
            "f1": sum(f1(t, q.answers) for t, q in pairs) / len(pairs)}


def _token_f1(ours: list[str], theirs: list[str]) -> float:
    if not ours or not theirs:
        return float(ours == theirs)
    common = sum((Counter(ours) & Counter(theirs)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ours), common / len(theirs)
    return 2 * precision * recall / (precision + recall)
