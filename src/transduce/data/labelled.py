"""Labelled text for sequence classification: {split}.tsv, one `label<TAB>text` a line,
or `label<TAB>text<TAB>text` for a pair (entailment, paraphrase: [CLS] A [SEP] B [SEP]).

A classification corpus is a directory of train.tsv, dev.tsv, test.tsv and corpus.json
with "kind": "classification" (`transduce data bible-genre` writes one). The classes are
labels.txt (one name a line, in the classifier's order) when it exists, else the labels
of train.tsv, sorted. Fields are stripped. A file holds single texts or pairs, not both:
its first line says which.

Errors name the file and line: a line without a tab or with more than two, an empty
label or text, a line of pairs in a file of single texts (or the reverse), a label of
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
    """The labelled lines of a TSV file, with their 1-based line numbers; `seconds` the
    second text of each pair (None: single texts)."""

    texts: list[str]
    labels: list[str]
    line_numbers: list[int]
    path: Path
    dropped_empty: list[int] = field(default_factory=list)
    seconds: list[str] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def summary(self) -> str:
        classes = len(set(self.labels))
        unit = "pairs" if self.seconds is not None else "lines"
        text = f"{self.path}: {len(self)} labelled {unit}, {classes} classes"
        if self.dropped_empty:
            text += f"; skipped {len(self.dropped_empty)} empty lines"
        return text


def read_labelled(path: Path | str) -> LabelledCorpus:
    """`label<TAB>text` or `label<TAB>text<TAB>text` lines, one kind a file; empty lines
    skipped. CorpusError names file:line."""
    path = Path(path)
    rows, numbers, empty = [], [], []
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            empty.append(number)
            continue
        fields = [part.strip() for part in line.split("\t")]
        _check_fields(fields, rows[0] if rows else None, f"{path}:{number}", numbers[:1])
        rows.append(fields)
        numbers.append(number)
    if not rows:
        raise CorpusError(f"{path}: no labelled line")
    columns = list(zip(*rows))
    return LabelledCorpus(list(columns[1]), list(columns[0]), numbers, path, empty,
                          list(columns[2]) if len(columns) == 3 else None)


def _check_fields(fields: list[str], first: list[str] | None, where: str,
                  first_number: list[int]) -> None:
    """A line's fields: label and one or two texts, none empty, as many as the file's
    first line has."""
    if len(fields) == 1:
        raise CorpusError(f"{where}: no tab; expected `label<TAB>text` (or "
                          f"`label<TAB>text<TAB>text` for a pair)")
    if len(fields) > 3:
        raise CorpusError(f"{where}: {len(fields) - 1} tabs; expected `label<TAB>text` or "
                          f"`label<TAB>text<TAB>text`")
    names = ("the label (before the first tab)", "the text (after the first tab)",
             "the second text (after the second tab)")
    for name, value in zip(names, fields):
        if not value:
            raise CorpusError(f"{where}: {name} is empty")
    if first is not None and len(fields) != len(first):
        kinds = {2: "a single text", 3: "a pair of texts"}
        raise CorpusError(f"{where}: {kinds[len(fields)]}, where line {first_number[0]} has "
                          f"{kinds[len(first)]}: a file holds one kind")


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


def write_labelled(path: Path, labels: list[str], texts: list[str],
                   seconds: list[str] | None = None) -> Path:
    """Write a TSV file whole (pairs with `seconds`), then rename it into place; each
    text's whitespace runs become one space."""
    rows = zip(labels, texts, seconds or [None] * len(texts))
    lines = []
    for label, *fields in rows:
        if "\t" in label or "\n" in label:
            raise CorpusError(f"{path}: label {label!r} holds a tab or line end")
        lines.append("\t".join([label, *(" ".join(f.split()) for f in fields if f is not None)]))
    return atomic.write_text(path, "".join(line + "\n" for line in lines))
