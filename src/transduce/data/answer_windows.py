"""A question and its context as an extractive answerer reads them, and the answer's
pieces as training labels them (BERT's SQuAD fine-tuning, Devlin et al. 2019, 4.2).

The context is split into words at whitespace and each word into the pieces the
tokenizer gives it within the text (data/tagged.py: word_pieces); the question is cut at
MAX_QUESTION_PIECES. A context longer than the model reads goes in windows of its pieces,
consecutive ones sharing `stride` pieces (at most half a window), each read as [CLS]
question [SEP] window [SEP] (RoBERTa's <s> question </s></s> window </s>).

Training labels each window with the positions of the answer's first and last pieces:
those of the first and last context words the answer's characters touch (answers are
read back as whole words, decode/answering.py), or [CLS]'s position 0 for both when the
window does not hold the answer whole, or the question has none (SQuAD 2.0's
unanswerable): BERT's labels. A question trains on its first answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from transduce.data.corpus import CorpusError
from transduce.data.squad import Question, qa_file, read_squad
from transduce.data.tagged import word_pieces

MAX_QUESTION_PIECES = 64      # BERT's max_query_length: a longer question is cut
STRIDE = 128                  # the pieces consecutive windows share (transformers' default)
SPAN_LABELS = ("start", "end")   # the head's two outputs, as transformers names them
SKIPPED_SHOWN = 5             # the ids a split's report names of the questions skipped


@dataclass(frozen=True)
class Window:
    """A window of pair `pair`'s context: the question's pieces, the window's pieces of
    the context, where they start among the context's pieces, and each one's word."""

    pair: int
    question: np.ndarray
    pieces: np.ndarray
    offset: int
    words: np.ndarray


@dataclass(frozen=True)
class ContextPieces:
    """A context's words (with their character offsets) and each of its pieces' word."""

    words: list[re.Match]
    owner: np.ndarray


def context_words(context: str) -> list[re.Match]:
    """The context's words (runs of non-space), with their character offsets."""
    return list(re.finditer(r"\S+", context))


def windows(pieces: int, room: int, stride: int) -> list[tuple[int, int]]:
    """Spans [a, b) of `pieces` pieces, each `room` long but the last, consecutive ones
    sharing min(stride, room // 2) pieces; none for no piece."""
    overlap = min(stride, room // 2)
    spans, start = [], 0
    while start < pieces:
        end = min(start + room, pieces)
        spans.append((start, end))
        if end == pieces:
            break
        start = end - overlap
    return spans


def context_windows(tokenizer, questions: Sequence[str], contexts: Sequence[str],
                    max_positions: int, one_segment: bool, stride: int = STRIDE
                    ) -> tuple[list[Window], list[ContextPieces]]:
    """The windows that cover each context (a context of no words: none) with its
    question in max_positions, and each context's words and pieces."""
    asked = [ids[:MAX_QUESTION_PIECES] for ids in tokenizer.encode(
        [question.strip() for question in questions])]
    found, read = [], []
    for pair, (question, context) in enumerate(zip(asked, contexts)):
        words = context_words(context)
        pieces = word_pieces(tokenizer, [word.group() for word in words])
        owner = np.repeat(np.arange(len(pieces)), [len(p) for p in pieces])
        read.append(ContextPieces(words, owner))
        flat = np.asarray([i for p in pieces for i in p], dtype=np.int64)
        room = max_positions - len(question) - 3 - one_segment
        if room < 1:
            raise ValueError(f"question {pair + 1}: {len(question)} pieces leave no room "
                             f"for its context in the model's {max_positions} positions")
        question = np.asarray(question, dtype=np.int64)
        found.extend(Window(pair, question, flat[a:b], a, owner[a:b])
                     for a, b in windows(len(flat), room, stride))
    return found, read


def first_context_position(question_pieces: int, one_segment: bool) -> int:
    """Where the context's pieces start in [CLS] question [SEP] (RoBERTa: </s></s>)
    context [SEP]."""
    return question_pieces + 2 + one_segment


def answer_pieces(context: ContextPieces, start: int, end: int) -> tuple[int, int] | None:
    """The context's first and last pieces of the words that characters [start, end)
    touch; None when they touch none."""
    touched = [n for n, word in enumerate(context.words)
               if word.start() < end and word.end() > start]
    if not touched:
        return None
    first = int(np.searchsorted(context.owner, touched[0], side="left"))
    last = int(np.searchsorted(context.owner, touched[-1], side="right")) - 1
    return first, last


def window_span(window: Window, pieces: tuple[int, int] | None, one_segment: bool
                ) -> tuple[int, int]:
    """The positions in the window's item of the answer's first and last pieces, or
    (0, 0) ([CLS]) when the window does not hold them both."""
    if pieces is None or not (window.offset <= pieces[0]
                              and pieces[1] < window.offset + len(window.pieces)):
        return 0, 0
    first = first_context_position(len(window.question), one_segment) - window.offset
    return first + pieces[0], first + pieces[1]


@dataclass
class TokenizedQuestions:
    """A question-answering split as training reads it: one item per window, [CLS]
    question [SEP] window [SEP], with its answer's positions."""

    questions: list[Question]
    ids: list[np.ndarray]          # each window's question pieces
    second_ids: list[np.ndarray]   # each window's context pieces
    spans: np.ndarray              # (windows, 2) int64: start and end positions in the item
    report: list[str]
    names: tuple[str, ...] = SPAN_LABELS


def load_qa_split(data_dir: Path | str, split: str, tokenizer, max_len: int,
                  one_segment: bool, stride: int = STRIDE) -> TokenizedQuestions:
    """{split}.json's questions in windows of max_len positions, labelled. A question
    whose answer has no answer_start is an error naming it; one whose answer_start does
    not point at its text, or whose context has no word, is skipped and counted in the
    report (BERT's training skips the answers it cannot find)."""
    path = qa_file(data_dir, split)
    questions = read_squad(path)
    missing = [q.id for q in questions if q.answers and q.answer_starts[0] is None]
    if missing:
        raise CorpusError(f"{path}: question {missing[0]!r} has no answer_start, which "
                          f"training needs ({len(missing)} such questions)")
    try:
        found, contexts = context_windows(tokenizer, [q.question for q in questions],
                                          [q.context for q in questions], max_len,
                                          one_segment, stride)
    except ValueError as error:
        raise CorpusError(f"{path}: {error} (max_len={max_len})") from None
    answers, skipped = _answers(questions, contexts)
    kept = [w for w in found if w.pair not in skipped]
    spans = np.asarray([window_span(w, answers[w.pair], one_segment) for w in kept],
                       dtype=np.int64).reshape(-1, 2)
    report = f"{path}: {len(questions)} questions in {len(kept)} windows of {max_len} " \
             f"positions"
    if skipped:
        shown = ", ".join(repr(questions[n].id) for n in sorted(skipped)[:SKIPPED_SHOWN])
        report += f"; {len(skipped)} skipped (no answer at answer_start, or no context): " \
                  f"{shown}"
    return TokenizedQuestions(questions, [w.question for w in kept],
                              [w.pieces for w in kept], spans, [report])


def _answers(questions: list[Question], contexts: list[ContextPieces]
             ) -> tuple[list[tuple[int, int] | None], set[int]]:
    """Each question's first answer as context pieces (None: unanswerable), and the
    questions that cannot train."""
    answers, skipped = [], set()
    for n, (question, context) in enumerate(zip(questions, contexts)):
        pieces = None
        if question.answers:
            text, start = question.answers[0], question.answer_starts[0]
            found = question.context[start:start + len(text)] == text
            pieces = answer_pieces(context, start, start + len(text)) if found else None
            if pieces is None:
                skipped.add(n)
        if not context.words:
            skipped.add(n)
        answers.append(pieces)
    return answers, skipped
