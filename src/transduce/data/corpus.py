"""Read and validate corpora: line-aligned parallel text, and monolingual text.

Any pair of UTF-8 files with one sentence per line is a parallel corpus ({split}.{lang},
the languages named in corpus.json). A classification corpus ({split}.tsv, "kind":
"classification") is read by data/labelled.py, a tagging corpus ({split}.conll, "kind":
"tagging") by data/tagged.py, a question-answering corpus ({split}.json in SQuAD's
layout, "kind": "qa") by data/squad.py. A text corpus, for language models, is one file per
split, {split}.txt, one line (a sentence, a verse, a document) per line; its corpus.json
says "kind": "text", and a directory of {split}.txt files without corpus.json is one too.

Problems that would silently corrupt training are errors naming the file and line: a
missing or empty file, invalid UTF-8, NUL bytes, different line counts. Empty lines are
not errors: they are dropped and counted (a pair with an empty side is dropped whole,
never shifted against the other side).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from transduce import atomic
from transduce.errors import TransduceError, not_there

SPLITS = ("train", "dev", "test")
METADATA = "corpus.json"
TEXT_SUFFIX = ".txt"
CorpusKind = Literal["parallel", "text", "classification", "tagging", "qa"]
KINDS = ("parallel", "text", "classification", "tagging", "qa")


class CorpusError(TransduceError, ValueError):
    """Bad input data; the message names the file and, where there is one, the line."""


@dataclass
class ParallelCorpus:
    """Sentence pairs that survived validation, with their 1-based line numbers."""

    source: list[str]
    target: list[str]
    line_numbers: list[int]
    source_path: Path
    target_path: Path
    dropped_empty: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.source)

    def summary(self) -> str:
        text = f"{self.source_path} / {self.target_path}: {len(self)} pairs"
        if self.dropped_empty:
            shown = ", ".join(str(n) for n in self.dropped_empty[:5])
            more = " ..." if len(self.dropped_empty) > 5 else ""
            text += f"; dropped {len(self.dropped_empty)} with an empty side (lines {shown}{more})"
        return text


def read_lines(path: Path | str, *, allow_empty: bool = False) -> list[str]:
    """All lines of a UTF-8 text file, without line ends. Errors name file and line."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(not_there(path))
    data = path.read_bytes()
    if not data:
        if allow_empty:
            return []
        raise CorpusError(f"{path}: the file is empty")
    if not data.strip() and not allow_empty:
        raise CorpusError(f"{path}: the file is empty")
    raw_lines = data.split(b"\n")
    if raw_lines[-1] == b"":
        raw_lines.pop()  # the final line end
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        nul = raw.find(b"\0")
        if nul >= 0:
            raise CorpusError(f"{path}:{number}: NUL byte at column {nul + 1}")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise CorpusError(f"{path}:{number}: invalid UTF-8 at byte {error.start + 1} of the "
                              f"line ({raw[error.start:error.start + 4]!r})") from None
        lines.append(line[:-1] if line.endswith("\r") else line)
    return lines


def read_parallel(source_path: Path | str, target_path: Path | str) -> ParallelCorpus:
    source_path, target_path = Path(source_path), Path(target_path)
    source, target = read_lines(source_path), read_lines(target_path)
    if len(source) != len(target):
        raise CorpusError(f"{source_path} has {len(source)} lines but {target_path} has "
                          f"{len(target)}: the files are not line-aligned"
                          f"{divergence_hint(source, target)}")
    kept_source, kept_target, numbers, empty = [], [], [], []
    for number, (s, t) in enumerate(zip(source, target), start=1):
        if not s.strip() or not t.strip():
            empty.append(number)
            continue
        kept_source.append(s.strip())
        kept_target.append(t.strip())
        numbers.append(number)
    if not numbers:
        raise CorpusError(f"{source_path} / {target_path}: no line pair has text on both sides")
    return ParallelCorpus(kept_source, kept_target, numbers, source_path, target_path, empty)


def divergence_hint(source: list[str], target: list[str]) -> str:
    """Where the two sides probably stop matching: the line k that best explains the
    lengths as aligned before k and shifted by the count difference from k on."""
    shift = len(target) - len(source)
    if abs(shift) > 20 or min(len(source), len(target)) < 3:
        return ""
    n = min(len(source), len(target))

    def mismatch(a: str, b: str) -> float:
        return abs(math.log((len(a) + 1) / (len(b) + 1)))

    def shifted(i: int) -> float:  # line i of the shorter side against i + |shift|
        return mismatch(source[i], target[i + shift]) if shift > 0 else \
            mismatch(source[i - shift], target[i])

    aligned_cost = [0.0]
    for i in range(n):
        aligned_cost.append(aligned_cost[-1] + mismatch(source[i], target[i]))
    shifted_suffix = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        shifted_suffix[i] = shifted_suffix[i + 1] + shifted(i)
    best = min(range(n + 1), key=lambda k: aligned_cost[k] + shifted_suffix[k])
    if best >= n:
        return ""
    return f"; they probably diverge near line {best + 1}"


def split_files(data_dir: Path | str, split: str) -> tuple[Path, Path]:
    """The (source, target) files of a split in a corpus directory: {split}.{lang}, with
    the languages named in corpus.json (which `transduce data` writes)."""
    data_dir = Path(data_dir)
    if corpus_kind(data_dir) == "classification":
        raise CorpusError(f"{data_dir} is a classification corpus ({{train,dev,test}}.tsv): "
                          f"it has no source side to translate from; train a classifier on "
                          f"it (--arch encoder --task classify)")
    if corpus_kind(data_dir) == "qa":
        raise CorpusError(f"{data_dir} is a question-answering corpus ({{split}}.json): it "
                          f"has no source side to translate from; evaluate a question "
                          f"answerer on it")
    if corpus_kind(data_dir) == "tagging":
        raise CorpusError(f"{data_dir} is a tagging corpus ({{train,dev,test}}.conll): it "
                          f"has no source side to translate from; train a token classifier "
                          f"on it (--arch encoder --task tag)")
    if corpus_kind(data_dir) == "text":
        raise CorpusError(f"{data_dir} is a text corpus ({{train,dev,test}}{TEXT_SUFFIX}): it "
                          f"has no source side to translate from; train a language model on "
                          f"it (--arch decoder)")
    metadata = data_dir / METADATA
    if metadata.is_file():
        languages = _read_metadata(metadata)
        try:
            return (data_dir / f"{split}.{languages['source_language']}",
                    data_dir / f"{split}.{languages['target_language']}")
        except (KeyError, TypeError) as error:
            raise CorpusError(f"{metadata}: expected a JSON object with source_language and "
                              f"target_language ({error})") from None
    found = ", ".join(sorted(p.name for p in data_dir.glob(f"{split}.*"))) or "no such files"
    raise CorpusError(f"{data_dir}: no {METADATA} saying which {split}.* file is the source "
                      f"(found {found}); write it as "
                      '{"source_language": "es", "target_language": "en"}')


def _read_metadata(metadata: Path) -> dict:
    try:
        values = json.loads(metadata.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorpusError(f"{metadata}: expected a JSON object with source_language and "
                          f"target_language, or \"kind\": \"text\" ({error})") from None
    if not isinstance(values, dict):
        raise CorpusError(f"{metadata}: expected a JSON object with source_language and "
                          f"target_language, or \"kind\": \"text\"")
    return values


def corpus_kind(data_dir: Path | str) -> CorpusKind:
    """"text" for a text corpus (corpus.json says so, or there is no corpus.json and
    there is a train.txt, dev.txt or test.txt), "classification" for labelled text
    (corpus.json says so, or no corpus.json and a train.tsv; data/labelled.py),
    "tagging" for tagged words (likewise, train.conll; data/tagged.py), "qa" for
    questions (likewise, a {split}.json; data/squad.py), else "parallel" (whose files
    split_files finds or explains)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise CorpusError(not_there(data_dir, "corpus directory"))
    metadata = data_dir / METADATA
    if metadata.is_file():
        kind = _read_metadata(metadata).get("kind", "parallel")
        if kind not in KINDS:
            raise CorpusError(f"{metadata}: \"kind\": {kind!r}; expected one of "
                              f"{', '.join(KINDS)}")
        return kind
    text = any((data_dir / f"{split}{TEXT_SUFFIX}").is_file() for split in SPLITS)
    if text:
        return "text"
    if (data_dir / "train.conll").is_file():
        return "tagging"
    if any((data_dir / f"{split}.json").is_file() for split in SPLITS):
        return "qa"
    return "classification" if (data_dir / "train.tsv").is_file() else "parallel"


def has_split(data_dir: Path | str, split: str) -> bool:
    """Whether the corpus directory holds this split (every file of it)."""
    data_dir = Path(data_dir)
    kind = corpus_kind(data_dir)
    if kind == "text":
        return text_file(data_dir, split).is_file()
    if kind in ("classification", "tagging", "qa"):
        suffix = {"classification": ".tsv", "tagging": ".conll", "qa": ".json"}[kind]
        return (data_dir / f"{split}{suffix}").is_file()
    return (data_dir / METADATA).is_file() and \
        all(path.is_file() for path in split_files(data_dir, split))


def language_pair(data_dir: Path | str) -> tuple[str, str] | None:
    """(source, target) of a parallel corpus, as its corpus.json names them; None for
    another kind of corpus."""
    data_dir = Path(data_dir)
    if corpus_kind(data_dir) != "parallel" or not (data_dir / METADATA).is_file():
        return None
    values = _read_metadata(data_dir / METADATA)
    pair = values.get("source_language"), values.get("target_language")
    return pair if all(isinstance(language, str) for language in pair) else None


def write_metadata(data_dir: Path, source_language: str, target_language: str, **extra) -> None:
    values = {"source_language": source_language, "target_language": target_language, **extra}
    atomic.write_text(data_dir / METADATA, json.dumps(values, indent=2) + "\n")


def read_split(data_dir: Path | str, split: str) -> ParallelCorpus:
    return read_parallel(*split_files(data_dir, split))


@dataclass
class TextCorpus:
    """The lines of a text file that have text, stripped, with their 1-based numbers."""

    lines: list[str]
    line_numbers: list[int]
    path: Path
    dropped_empty: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lines)

    def summary(self) -> str:
        text = f"{self.path}: {len(self)} lines"
        if self.dropped_empty:
            shown = ", ".join(str(n) for n in self.dropped_empty[:5])
            more = " ..." if len(self.dropped_empty) > 5 else ""
            text += f"; skipped {len(self.dropped_empty)} empty (lines {shown}{more})"
        return text


def read_text(path: Path | str) -> TextCorpus:
    """A monolingual text file: every line with text (stripped), empty lines skipped and
    counted. Errors (read_lines) name the file and line."""
    path = Path(path)
    kept, numbers, empty = [], [], []
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            empty.append(number)
            continue
        kept.append(line.strip())
        numbers.append(number)
    if not kept:
        raise CorpusError(f"{path}: no line has text")
    return TextCorpus(kept, numbers, path, empty)


def text_file(data_dir: Path | str, split: str) -> Path:
    """The file of a split of a text corpus: {split}.txt."""
    data_dir = Path(data_dir)
    if corpus_kind(data_dir) != "text":
        raise CorpusError(f"{data_dir} is not a text corpus (neither a {METADATA} with "
                          f"\"kind\": \"text\" nor {{train,dev,test}}{TEXT_SUFFIX} files): a "
                          f"language model reads {split}{TEXT_SUFFIX}; make a text corpus with "
                          f"`transduce data bible-text`")
    return data_dir / f"{split}{TEXT_SUFFIX}"


def read_text_split(data_dir: Path | str, split: str) -> TextCorpus:
    return read_text(text_file(data_dir, split))


def write_text_metadata(data_dir: Path, language: str, kind: CorpusKind = "text",
                        **extra) -> None:
    """corpus.json of a text (or classification) corpus: {"kind": "text", "language":
    ..., ...}."""
    values = {"kind": kind, "language": language, **extra}
    atomic.write_text(data_dir / METADATA, json.dumps(values, indent=2) + "\n")
