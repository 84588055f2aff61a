"""Tagged words for token classification (named entities, parts of speech): {split}.conll
in CoNLL's layout, one word a line with its tag in the last column (columns separated by
tabs or spaces: `word<TAB>tag`, or CoNLL-2003's `word POS chunk tag`), a blank line after
each sentence; `-DOCSTART-` lines are skipped.

A tagging corpus is a directory of train.conll, dev.conll, test.conll and corpus.json
with "kind": "tagging". The tags are labels.txt (one a line, in the head's order) when it
exists, else train.conll's, sorted. Errors name the file and line: a line of one column,
a tag of dev or test (or of train, with labels.txt) that is not among the tags, a file
of no sentence.

A sentence becomes pieces as the tokenizer pieces its words in a line (word_pieces), and
each word's tag goes to its first piece, the others scored by nothing (IGNORE): BERT's
way of labelling words (Devlin et al. 2019, section 5.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from transduce.data.corpus import CorpusError, read_lines
from transduce.data.labelled import LABELS_FILE, class_names
from transduce.data.masking import IGNORE

CONLL_SUFFIX = ".conll"
DOCUMENT_START = "-DOCSTART-"


@dataclass
class TaggedCorpus:
    """The sentences of a .conll file: words, tags, and each sentence's first line."""

    words: list[list[str]]
    tags: list[list[str]]
    line_numbers: list[int]
    path: Path

    def __len__(self) -> int:
        return len(self.words)

    def summary(self) -> str:
        count = sum(map(len, self.words))
        kinds = len({tag for tags in self.tags for tag in tags})
        return f"{self.path}: {len(self)} sentences, {count} tagged words, {kinds} tags"


def tagged_file(data_dir: Path | str, split: str) -> Path:
    return Path(data_dir) / f"{split}{CONLL_SUFFIX}"


def read_tagged(path: Path | str) -> TaggedCorpus:
    """A .conll file's sentences; CorpusError names file:line."""
    path = Path(path)
    corpus = TaggedCorpus([], [], [], path)
    words: list[str] = []
    tags: list[str] = []
    for number, line in enumerate([*read_lines(path), ""], start=1):
        columns = line.split()
        if columns[:1] == [DOCUMENT_START]:
            continue
        if not columns:
            if words:
                corpus.words.append(words)
                corpus.tags.append(tags)
                words, tags = [], []
            continue
        if len(columns) == 1:
            raise CorpusError(f"{path}:{number}: one column ({columns[0]!r}); expected "
                              f"`word<TAB>tag` (the tag in the last column)")
        if not words:
            corpus.line_numbers.append(number)
        words.append(columns[0])
        tags.append(columns[-1])
    if not corpus.words:
        raise CorpusError(f"{path}: no tagged sentence")
    return corpus


def tag_names(data_dir: Path | str) -> list[str]:
    """The tags in the head's order: labels.txt, else train.conll's, sorted."""
    if (Path(data_dir) / LABELS_FILE).is_file():
        return class_names(data_dir)
    return sorted({tag for tags in read_tagged(tagged_file(data_dir, "train")).tags
                   for tag in tags})


def word_pieces(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each word's ids as the tokenizer pieces it within a line of these words: the first
    as a text starts, the others after a space (which byte-level BPE keeps, and
    WordPiece and SentencePiece read as a word boundary)."""
    if not words:
        return []
    return tokenizer.encode([words[0], *(" " + word for word in words[1:])])


def sentence_pieces(tokenizer, corpus: TaggedCorpus, names: list[str]
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each sentence's ids (no specials), and its tags by piece: a word's tag index at
    its first piece, IGNORE at the others (a word of no piece takes the unknown
    piece). A tag that is not among `names` is named by file:line."""
    index = {name: i for i, name in enumerate(names)}
    all_ids, all_tags = [], []
    for words, tags, first in zip(corpus.words, corpus.tags, corpus.line_numbers):
        ids, by_piece = [], []
        for offset, (pieces, tag) in enumerate(zip(word_pieces(tokenizer, words), tags)):
            if tag not in index:
                raise CorpusError(f"{corpus.path}:{first + offset}: tag {tag!r} is not one "
                                  f"of the {len(names)} tags ({', '.join(names[:10])}"
                                  f"{' ...' if len(names) > 10 else ''})")
            pieces = pieces or [tokenizer.unk_id or 0]
            ids.extend(pieces)
            by_piece.extend([index[tag]] + [IGNORE] * (len(pieces) - 1))
        all_ids.append(np.asarray(ids, dtype=np.int32))
        all_tags.append(np.asarray(by_piece, dtype=np.int32))
    return all_ids, all_tags


@dataclass
class TokenizedTagged:
    """A tagging split as each sentence's ids (no specials) and tag indices by piece
    (IGNORE but at words' first pieces), the tags' names in the head's order."""

    corpus: TaggedCorpus
    ids: list[np.ndarray]
    tags: list[np.ndarray]
    names: list[str]
    report: list[str]


def load_tagged_split(data_dir: Path | str, split: str, tokenizer, names: list[str]
                      ) -> TokenizedTagged:
    """{split}.conll as pieces and tags; a tag not among `names` is an error naming file
    and line. Long sentences are kept (the encoder batcher crops them)."""
    corpus = read_tagged(tagged_file(data_dir, split))
    ids, tags = sentence_pieces(tokenizer, corpus, names)
    return TokenizedTagged(corpus, ids, tags, names, [corpus.summary()])
