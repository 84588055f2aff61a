"""Extractive question answering with an encoder whose head scores each token's starting
and ending the answer (ModelConfig.question_answering: BERT's SQuAD head, Devlin et al.
2019, section 4.2). A question and its context are read as [CLS] question [SEP] context
[SEP] (RoBERTa's <s> question </s></s> context </s>), the context split into words at
whitespace and each word into the pieces the tokenizer gives it within the text. A
context longer than the model reads is read in windows of its pieces that overlap by
`stride` pieces. In each window the start and end scores over [CLS] and the context's
pieces go through a softmax each, and a span from piece i to piece j of the context (j >=
i, at most `max_answer_pieces` long) scores p_start(i) * p_end(j), as the
question-answering pipeline of transformers 4 scored it (version 5 has none): [CLS] is
where an answerer trained on windows points when a window holds no answer (data/
answer_windows.py), so its share keeps such a window's spans low. The best spans over
all windows are the answers, each given as the context's text from the first character
of i's word to the last of j's (the words a span touches, whole, as BERT's evaluation
reads them back). With no_answer (SQuAD 2.0's unanswerable questions; the pipeline's
handle_impossible_answer), the empty answer competes too, scored by the least of the
windows' p_start([CLS]) * p_end([CLS])."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from transduce.data.answer_windows import STRIDE, context_windows, first_context_position
from transduce.data.masking import encoder_item

MAX_ANSWER_PIECES = 30        # BERT's max_answer_length
CANDIDATES = 20               # the best starts and ends a window's spans are made of


@dataclass(frozen=True)
class Answer:
    text: str
    start: int          # the answer's characters in the context: [start, end)
    end: int
    score: float        # p_start * p_end in its window


@dataclass(frozen=True)
class SpanItem:
    """One model input: a window of pair `pair`'s context. ids and segments (T,); the
    position of the window's first context piece; each of its pieces' word."""

    pair: int
    ids: np.ndarray
    segments: np.ndarray
    first: int
    words: np.ndarray


def span_items(tokenizer, questions: Sequence[str], contexts: Sequence[str],
               max_positions: int, one_segment: bool, stride: int = STRIDE
               ) -> tuple[list[SpanItem], list[list[re.Match]]]:
    """The model inputs that cover each context (a context of no words: none), and each
    context's words."""
    found, read = context_windows(tokenizer, questions, contexts, max_positions,
                                  one_segment, stride)
    items = []
    for window in found:
        ids, segments, _ = encoder_item(window.question, window.pieces, tokenizer.bos_id,
                                        tokenizer.eos_id, one_segment)
        items.append(SpanItem(window.pair, ids, segments,
                              first_context_position(len(window.question), one_segment),
                              window.words))
    return items, [context.words for context in read]


def best_spans(start_logits: np.ndarray, end_logits: np.ndarray, max_pieces: int,
               count: int | None = None) -> tuple[list[tuple[int, int, float]], float]:
    """A window's best spans (i, j, p_start(i) * p_end(j)) over its context's pieces,
    best first, and its no-answer score p_start([CLS]) * p_end([CLS]). start and end
    logits (1 + L,) each: [CLS]'s, then the context's L pieces'; i and j count the
    context's pieces, j - i < max_pieces; the spans are those of the CANDIDATES best
    starts and ends, at most `count` of them (None: all; spans of the same words are told
    apart later, by answers_of)."""
    p_start, p_end = _softmax(start_logits), _softmax(end_logits)
    starts = np.argsort(-p_start[1:])[:CANDIDATES]
    ends = np.argsort(-p_end[1:])[:CANDIDATES]
    spans = [(int(i), int(j), float(p_start[1 + i] * p_end[1 + j])) for i in starts
             for j in ends if i <= j < i + max_pieces]
    return sorted(spans, key=lambda span: -span[2])[:count], float(p_start[0] * p_end[0])


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def answers_of(found: list[tuple[float, int, int]], context: str, words: list[re.Match],
               count: int, no_answer: float | None = None) -> list[Answer]:
    """A context's best answers from its windows' spans (score, first word, last word):
    the same words found in two windows count once, at their better score; no_answer:
    the empty answer's score, when it competes (Answer("", 0, 0, score))."""
    best: dict[tuple[int, int], float] = {}
    for score, first, last in found:
        best[first, last] = max(score, best.get((first, last), 0.0))
    answers = [Answer(context[words[a].start():words[b].end()], words[a].start(),
                      words[b].end(), score) for (a, b), score in best.items()]
    if no_answer is not None:
        answers.append(Answer("", 0, 0, no_answer))
    return sorted(answers, key=lambda answer: -answer.score)[:count]
