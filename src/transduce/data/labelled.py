"""Labelled text for sequence classification: {split}.tsv, one `label<TAB>text` a line.

A classification corpus is a directory of train.tsv, dev.tsv, test.tsv and corpus.json
with "kind": "classification" (`transduce data bible-genre` writes one). The classes are
labels.txt (one name a line, in the classifier's order) when it exists, else the labels
of train.tsv, sorted. The text is everything after the first tab, stripped.

Errors name the file and line: a line without a tab, an empty label or text, a label of
dev or test (or of train, with labels.txt) that is not among the classes. Empty lines
are skipped and counted, as in text corpora.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transduce import atomic
from transduce.data.corpus import CorpusError, read_lines

TSV_SUFFIX = ".tsv"
LABELS_FILE = "labels.txt"


@dataclass
class LabelledCorpus:
    """The labelled lines of a TSV file, with their 1-based line numbers."""

    texts: list[str]
    labels: list[str]
    line_numbers: list[int]
    path: Path
    dropped_empty: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    def summary(self) -> str:
        classes = len(set(self.labels))
        text = f"{self.path}: {len(self)} labelled lines, {classes} classes"
        if self.dropped_empty:
            text += f"; skipped {len(self.dropped_empty)} empty lines"
        return text


def read_labelled(path: Path | str) -> LabelledCorpus:
    """`label<TAB>text` lines; empty lines skipped. CorpusError names file:line."""
    path = Path(path)
    texts, labels, numbers, empty = [], [], [], []
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            empty.append(number)
            continue
        label, tab, text = line.partition("\t")
        if not tab:
            raise CorpusError(f"{path}:{number}: no tab; expected `label<TAB>text`")
        if not label.strip():
            raise CorpusError(f"{path}:{number}: the label (before the tab) is empty")
        if not text.strip():
            raise CorpusError(f"{path}:{number}: the text (after the tab) is empty")
        texts.append(text.strip())
        labels.append(label.strip())
        numbers.append(number)
    if not texts:
        raise CorpusError(f"{path}: no labelled line")
    return LabelledCorpus(texts, labels, numbers, path, empty)


def labelled_file(data_dir: Path | str, split: str) -> Path:
    return Path(data_dir) / f"{split}{TSV_SUFFIX}"


def class_names(data_dir: Path | str) -> list[str]:
    """The classes in the classifier's order: labels.txt, else train.tsv's, sorted."""
    listed = Path(data_dir) / LABELS_FILE
    if listed.is_file():
        names = [name.strip() for name in read_lines(listed)]
        for number, name in enumerate(names, start=1):
            if not name:
                raise CorpusError(f"{listed}:{number}: an empty class name")
            if name in names[:number - 1]:
                raise CorpusError(f"{listed}:{number}: class {name!r} is listed twice")
        return names
    return sorted(set(read_labelled(labelled_file(data_dir, "train")).labels))


def label_indices(corpus: LabelledCorpus, names: list[str]) -> list[int]:
    """Each line's class index; a label that is not a class is named by file:line."""
    index = {name: i for i, name in enumerate(names)}
    for label, number in zip(corpus.labels, corpus.line_numbers):
        if label not in index:
            raise CorpusError(f"{corpus.path}:{number}: label {label!r} is not one of the "
                              f"{len(names)} classes ({', '.join(names[:10])}"
                              f"{' ...' if len(names) > 10 else ''})")
    return [index[label] for label in corpus.labels]


def write_labelled(path: Path, labels: list[str], texts: list[str]) -> Path:
    """Write a TSV file whole, then rename it into place."""
    for label, text in zip(labels, texts):
        if "\t" in label or "\n" in label + text:
            raise CorpusError(f"{path}: label {label!r} or its text holds a tab or line end")
    return atomic.write_text(path, "".join(f"{label}\t{' '.join(text.split())}\n"
                                           for label, text in zip(labels, texts)))
