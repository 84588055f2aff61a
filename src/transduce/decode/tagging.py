"""Token classification (named entities, parts of speech) with an encoder whose head labels
each token (ModelConfig.token_classifier): a line is split into words at whitespace, each
word into the pieces the tokenizer gives it within the line (the first word as a text
starts, the others after a space), and a word takes the tag of its first piece, as BERT's
named-entity fine-tuning labels words (Devlin et al. 2019, section 5.3) and as
transformers' token-classification models are trained. A line longer than the model
reads is tagged in consecutive chunks of whole words, each read as [CLS] chunk [SEP]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from transduce.data.tagged import word_pieces
from transduce.data.tokenizer import TextTokenizer


@dataclass(frozen=True)
class TaggedWord:
    word: str
    tag: str
    probability: float      # the tag's, at the word's first piece


@dataclass(frozen=True)
class TagItem:
    """One model input: the words [start, end) of line `line`, as [CLS] pieces [SEP]
    ids (T,), and the position of each word's first piece in it (end - start,)."""

    line: int
    start: int
    end: int
    ids: np.ndarray
    firsts: np.ndarray


def chunks(pieces: Sequence[Sequence[int]], room: int) -> list[tuple[int, int]]:
    """Consecutive spans [start, end) of the words whose pieces fit `room` together, each
    as long as it can be (a word longer than room alone is a span of its own, which
    tag_items cuts to its first pieces)."""
    spans, start, used = [], 0, 0
    for index, word in enumerate(pieces):
        if index > start and used + len(word) > room:
            spans.append((start, index))
            start, used = index, 0
        used += len(word)
    if start < len(pieces):
        spans.append((start, len(pieces)))
    return spans


def tag_items(tokenizer: TextTokenizer, words: Sequence[Sequence[str]], max_positions: int
              ) -> list[TagItem]:
    """The model inputs that cover every word of every line (a line of no words: none)."""
    room = max_positions - 2
    items = []
    for line, line_words in enumerate(words):
        pieces = word_pieces(tokenizer, line_words)
        for start, end in chunks(pieces, room):
            ids, firsts = [tokenizer.bos_id], []
            for word in pieces[start:end]:
                firsts.append(len(ids))
                ids.extend(word[:max(room - (len(ids) - 1), 1)] or [tokenizer.unk_id or 0])
            ids.append(tokenizer.eos_id)
            items.append(TagItem(line, start, end, np.asarray(ids, dtype=np.int64),
                                 np.asarray(firsts, dtype=np.int64)))
    return items


@dataclass(frozen=True)
class Entity:
    """A span of words [start, end) of one kind ("PER"), and its words joined."""

    kind: str
    start: int
    end: int
    text: str


def entities(words: Sequence[str], tags: Sequence[str]) -> list[Entity]:
    """The entities of BIO tags (B-X begins one of kind X, I-X continues it; an I-X
    after anything else begins one too, as IOB1 and conlleval read it; O, or a tag of
    no kind, is outside), in order."""
    found, start, kind = [], None, None

    def close(end: int) -> None:
        if start is not None:
            found.append(Entity(kind, start, end, " ".join(words[start:end])))

    for index, tag in enumerate(tags):
        prefix, _, tag_kind = tag.partition("-")
        inside = prefix == "I" and tag_kind == kind and start is not None
        if not inside:
            close(index)
            start, kind = (index, tag_kind) if prefix in ("B", "I") and tag_kind else \
                (None, None)
    close(len(tags))
    return found


def entity_scores(predicted: Sequence[Sequence[str]], gold: Sequence[Sequence[str]]
                  ) -> dict[str, float]:
    """Entity-level precision, recall and F1 of predicted BIO tags against the gold ones,
    sentence by sentence, as conlleval counts them: an entity is right when its kind and
    both ends are (F1 0 when nothing is right); "entities": the gold entities' count."""
    right = found = wanted = 0
    for guess, truth in zip(predicted, gold, strict=True):
        blank = [""] * len(truth)
        ours = {(e.kind, e.start, e.end) for e in entities(blank, guess)}
        theirs = {(e.kind, e.start, e.end) for e in entities(blank, truth)}
        right, found, wanted = right + len(ours & theirs), found + len(ours), \
            wanted + len(theirs)
    precision = right / found if found else 0.0
    recall = right / wanted if wanted else 0.0
    f1 = 2 * precision * recall / (precision + recall) if right else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "entities": wanted}
