"""`transduce data import`: raw parallel text -> a corpus directory (train|dev|test.{src,tgt}).

Inputs are two line-aligned files (--src, --tgt) or one TSV file of two columns (--tsv),
each plain, gzip (.gz), xz (.xz) or Zstandard (.zst), chosen by the file's name. Input is
streamed: memory holds 16 bytes per pair (its hash, for the split and the duplicate
check, and its line number), never the corpus.

Cleaning is counted and reported, never silent; each rule's count comes with the first
few places (file:line) it applied:

- invalid UTF-8: the pair is dropped (--strict: an error naming file, line and byte);
- control characters (C0 but tab, DEL, C1): removed from the text, the pair kept;
- an empty side (after stripping whitespace): the pair is dropped;
- more than --max-words whitespace-separated words on a side: dropped;
- a length ratio (words, longer side / shorter side) over --max-ratio: dropped;
- an exact duplicate of an earlier pair (after cleaning; equal 64-bit hashes): dropped;
- with --dev-src/--test-src files: a training pair that is also a dev or test pair.

The split. A pair's place is decided by a hash of its text (BLAKE2b of source, tab,
target), never by its position: pairs whose hash is below the dev threshold are dev, below
the test threshold test, the rest train. --dev N / --test N set the thresholds to the N-th
and 2N-th smallest hashes of this import; they are written to corpus.json, and a later
import into the same --out (the corpus grown, or reordered) reuses them, so no pair ever
moves from one split to another: the new pairs fall where their hashes say, and dev and
test grow in proportion. Importing the same pairs in any order gives the same files.

The output directory is written under a temporary name and renamed into place
(transduce.atomic): a failed or killed import leaves the previous corpus as it was.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import lzma
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from transduce import atomic
from transduce.data.corpus import METADATA, CorpusError
from transduce.errors import not_there

SPLIT_SCHEME = "blake2b-64 of source + tab + target"
SHOWN = 5   # places listed per cleaning rule
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")   # C0 but tab (and line ends), DEL, C1


# Opening files -------------------------------------------------------------------------

def open_binary(path: Path) -> BinaryIO:
    """The file's bytes, decompressed by its suffix (.gz, .xz, .zst; anything else plain).
    A file whose suffix promises a compression it does not have is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(not_there(path))
    suffix = path.suffix.lower()
    magic = {".gz": b"\x1f\x8b", ".xz": b"\xfd7zXZ\x00", ".zst": b"\x28\xb5\x2f\xfd"}
    if suffix in magic:
        with open(path, "rb") as probe:
            head = probe.read(len(magic[suffix]))
        if head != magic[suffix]:
            raise CorpusError(f"{path}: not a {suffix[1:]} file (its first bytes are "
                              f"{head!r}); rename it if it is plain text")
    if suffix == ".gz":
        return gzip.open(path, "rb")   # type: ignore[return-value]
    if suffix == ".xz":
        return lzma.open(path, "rb")   # type: ignore[return-value]
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise CorpusError(f"{path}: reading .zst needs the zstandard package "
                              f"(pip install zstandard)") from None
        handle = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(  # type: ignore
            handle, closefd=True))
    return open(path, "rb")


def raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes without its line end), streamed. A damaged
    compressed file is an error naming the file and the line where it broke."""
    number = 0
    try:
        with open_binary(path) as handle:
            for number, line in enumerate(handle, start=1):
                if line.endswith(b"\n"):
                    line = line[:-1]
                if line.endswith(b"\r"):
                    line = line[:-1]
                yield number, line
    except CorpusError:
        raise
    except Exception as error:   # OSError, EOFError, LZMAError, zstandard.ZstdError
        if not isinstance(error, (OSError, EOFError, lzma.LZMAError)) \
                and type(error).__name__ != "ZstdError":
            raise
        raise CorpusError(f"{path}:{number + 1}: cannot read past line {number}: "
                          f"{str(error) or type(error).__name__} (a truncated or damaged "
                          f"file?)") from None


Files = tuple[Path, Path]   # where a pair's source and target come from (one TSV: twice)


def raw_pairs(src: Path | None, tgt: Path | None, tsv: Path | None
              ) -> Iterator[tuple[Files, int, bytes, bytes]]:
    """(files, line number, source bytes, target bytes) from two aligned files or a TSV.
    Different line counts and TSV lines without exactly two columns are errors naming
    the file and line."""
    if tsv is not None:
        for number, line in raw_lines(tsv):
            columns = line.split(b"\t")
            if len(columns) != 2:
                raise CorpusError(f"{tsv}:{number}: expected 2 tab-separated columns "
                                  f"(source, target), found {len(columns)}")
            yield (tsv, tsv), number, columns[0], columns[1]
        return
    assert src is not None and tgt is not None
    source, target = raw_lines(src), raw_lines(tgt)
    last = 0
    while True:
        s, t = next(source, None), next(target, None)
        if s is None or t is None:
            break
        last = s[0]
        yield (src, tgt), last, s[1], t[1]
    if s is not None or t is not None:
        longer, shorter = (src, tgt) if s is not None else (tgt, src)
        raise CorpusError(f"{longer}:{last + 1}: {shorter} ends after line {last} but "
                          f"{longer} goes on: the files are not line-aligned")


# Cleaning ------------------------------------------------------------------------------

@dataclass(frozen=True)
class CleaningRules:
    max_words: int = 250        # 0: no limit
    max_ratio: float = 9.0      # 0: no limit (Moses clean-corpus-n's default ratio)
    strict: bool = False        # invalid UTF-8 is an error, not a dropped pair
    dedupe: bool = True


@dataclass
class RuleCount:
    name: str
    action: str                 # "dropped" or "cleaned"
    count: int = 0
    places: list[str] = field(default_factory=list)

    def add(self, place: str) -> None:
        self.count += 1
        if len(self.places) < SHOWN:
            self.places.append(place)

    def line(self, total: int) -> str:
        more = " ..." if self.count > len(self.places) else ""
        where = f" (first: {', '.join(self.places)}{more})" if self.places else ""
        return f"  {self.name}: {self.count} {self.action} ({percent(self.count, total)}){where}"


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


class Cleaner:
    """Applies the rules to raw pairs and counts what each rule did."""

    def __init__(self, rules: CleaningRules, label: str = "train"):
        self.rules, self.label = rules, label
        self.counts = {key: RuleCount(name, action) for key, name, action in (
            ("utf8", "invalid UTF-8", "dropped"),
            ("control", "control characters removed", "cleaned"),
            ("empty", "an empty side", "dropped"),
            ("long", f"more than {rules.max_words} words on a side", "dropped"),
            ("ratio", f"length ratio over {rules.max_ratio:g}", "dropped"),
            ("duplicate", "exact duplicate of an earlier pair", "dropped"),
            ("overlap", "also a dev or test pair", "dropped"))}
        self.read = 0
        self.kept = 0

    def clean(self, files: Files, number: int, src: bytes, tgt: bytes, *,
              filters: bool = True) -> tuple[str, str] | None:
        """The cleaned pair, or None when a rule drops it. filters=False: only the rules
        that make text usable (UTF-8, control characters, empty sides), for dev and test
        sets, which are never filtered by length. Duplicates are found after all pairs
        are read (import_corpus), from their hashes."""
        self.read += 1
        place = f"{files[0]}:{number}"
        texts = []
        for path, raw in zip(files, (src, tgt)):
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError as error:
                message = (f"{path}:{number}: invalid UTF-8 at byte {error.start + 1} of the "
                           f"line ({raw[error.start:error.start + 4]!r})")
                if self.rules.strict:
                    raise CorpusError(message + "; without --strict such pairs are dropped "
                                                "and counted") from None
                self.counts["utf8"].add(f"{path}:{number}")
                return None
        cleaned = [_CONTROL.sub("", text) for text in texts]
        if cleaned != texts:
            self.counts["control"].add(place)
        s, t = (text.strip() for text in cleaned)
        if not s or not t:
            self.counts["empty"].add(place)
            return None
        if filters:
            words = len(s.split()), len(t.split())
            if self.rules.max_words and max(words) > self.rules.max_words:
                self.counts["long"].add(place)
                return None
            if self.rules.max_ratio and max(words) > self.rules.max_ratio * min(words):
                self.counts["ratio"].add(place)
                return None
        self.kept += 1
        return s, t

    def report(self) -> list[str]:
        lines = [f"{self.label}: read {self.read} pairs, kept {self.kept} "
                 f"({percent(self.kept, self.read)})"]
        lines += [count.line(self.read) for count in self.counts.values() if count.count]
        return lines

    def summary(self) -> dict:
        return {"read": self.read, "kept": self.kept,
                **{key: count.count for key, count in self.counts.items()}}


def pair_hash(source: str, target: str) -> int:
    """The pair's 64-bit hash: where it falls in the split, and its duplicate key."""
    digest = hashlib.blake2b(f"{source}\t{target}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def split_of(hash_value: int, dev_below: int, test_below: int) -> str:
    """Which split a pair of this hash belongs to, under the thresholds."""
    if hash_value < dev_below:
        return "dev"
    if hash_value < test_below:
        return "test"
    return "train"


# The import ----------------------------------------------------------------------------

@dataclass
class ImportResult:
    out: Path
    sizes: dict[str, int]
    report: list[str]


def import_corpus(out: Path, source_language: str, target_language: str, *,
                  src: Path | None = None, tgt: Path | None = None, tsv: Path | None = None,
                  dev: int = 0, test: int = 0,
                  dev_files: tuple[Path, Path] | None = None,
                  test_files: tuple[Path, Path] | None = None,
                  rules: CleaningRules = CleaningRules(), resplit: bool = False,
                  progress: bool | None = None) -> ImportResult:
    """Clean raw pairs and write out/{train,dev,test}.{source,target language} and
    corpus.json. dev/test: pairs held out by hash (see the module's notes); dev_files /
    test_files: given sets instead (the held-out counts must then be 0)."""
    out = Path(out)
    _check_arguments(src, tgt, tsv, source_language, target_language, dev, test, dev_files,
                     test_files)
    previous = _previous_split(out, resplit)
    languages = (source_language, target_language)
    with atomic.atomic_directory(out) as scratch:
        held_out, report = _read_given_sets(dev_files, test_files, rules, progress)
        cleaned = _clean(scratch, src, tgt, tsv, rules, held_out, progress)
        report = cleaned.cleaner.report() + report
        thresholds, notes = _thresholds(cleaned, previous, sorted(held_out), dev, test, out)
        sizes = _write_splits(scratch, languages, cleaned, thresholds, held_out)
        metadata = {"source_language": source_language, "target_language": target_language,
                    "import": {
                        "inputs": [str(p) for p in (tsv,) if p] or [str(src), str(tgt)],
                        "rules": {"max_words": rules.max_words, "max_ratio": rules.max_ratio,
                                  "strict": rules.strict, "dedupe": rules.dedupe},
                        "cleaning": cleaned.cleaner.summary(),
                        "split": {"scheme": SPLIT_SCHEME, "dev_below": thresholds[0],
                                  "test_below": thresholds[1], "given_files": sorted(held_out)},
                        "sizes": sizes}}
        (scratch / METADATA).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    report += notes + ["split: " + ", ".join(f"{name} {size}" for name, size in sizes.items())]
    return ImportResult(out, sizes, report)


def _check_arguments(src, tgt, tsv, source_language: str, target_language: str, dev: int,
                     test: int, dev_files, test_files) -> None:
    if (tsv is None) == (src is None or tgt is None) or (src is None) != (tgt is None):
        raise CorpusError("give either --src and --tgt (two aligned files) or --tsv (one file)")
    if source_language == target_language:
        raise CorpusError(f"source and target language are both {source_language!r}: the "
                          f"files {{split}}.{source_language} would be one file")
    for language in (source_language, target_language):
        if not re.fullmatch(r"[A-Za-z0-9_-]+", language):
            raise CorpusError(f"language code {language!r}: use letters, digits, '-' or '_' "
                              f"(it names the files)")
    if dev_files is not None and dev or test_files is not None and test:
        raise CorpusError("give dev (and test) either as a count held out by hash or as "
                          "files, not both")


def _read_given_sets(dev_files, test_files, rules: CleaningRules, progress: bool | None
                     ) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """The dev/test sets given as files, cleaned without the filters -> pairs by split
    name, and their cleaning reports."""
    from tqdm import tqdm

    held_out, report = {}, []
    for name, files in (("dev", dev_files), ("test", test_files)):
        if files is None:
            continue
        cleaner = Cleaner(rules, name)
        pairs = []
        for pair_files, number, s, t in tqdm(raw_pairs(files[0], files[1], None),
                                             desc=f"reading {name}", unit=" lines",
                                             unit_scale=True, disable=_disabled(progress)):
            pair = cleaner.clean(pair_files, number, s, t, filters=False)
            if pair is not None:
                pairs.append(pair)
        if not pairs:
            raise CorpusError(f"{files[0]} / {files[1]}: no usable pair")
        held_out[name] = pairs
        report += cleaner.report()
    return held_out, report


@dataclass
class _Cleaned:
    """Pass 1's result: every cleaned pair in one file per side, and per pair its hash
    and whether it is kept (False: an exact duplicate of an earlier one)."""
    cleaner: Cleaner
    all_src: Path
    all_tgt: Path
    hashes: np.ndarray
    keep: np.ndarray


def _clean(scratch: Path, src, tgt, tsv, rules: CleaningRules,
           held_out: dict[str, list[tuple[str, str]]], progress: bool | None) -> _Cleaned:
    """Pass 1: clean everything into one file per side, remembering each pair's hash and
    line (16 bytes a pair: the corpus itself is never held in memory)."""
    from tqdm import tqdm

    cleaner = Cleaner(rules)
    held_keys = {pair_hash(*pair) for pairs in held_out.values() for pair in pairs}
    all_src, all_tgt = scratch / ".all.src", scratch / ".all.tgt"
    hashes, lines = _Growing(np.uint64), _Growing(np.uint64)
    with open(all_src, "w", encoding="utf-8", newline="\n") as s_out, \
            open(all_tgt, "w", encoding="utf-8", newline="\n") as t_out:
        for files, number, s, t in tqdm(raw_pairs(src, tgt, tsv), desc="cleaning",
                                        unit=" lines", unit_scale=True,
                                        disable=_disabled(progress)):
            pair = cleaner.clean(files, number, s, t)
            if pair is None:
                continue
            key = pair_hash(*pair)
            if key in held_keys:
                cleaner.counts["overlap"].add(f"{files[0]}:{number}")
                cleaner.kept -= 1
                continue
            hashes.append(key)
            lines.append(number)
            s_out.write(pair[0] + "\n")
            t_out.write(pair[1] + "\n")
    values = hashes.array()
    keep = _first_occurrences(values, lines.array(), cleaner, tsv if tsv is not None else src,
                              rules.dedupe)
    if not keep.any():
        raise CorpusError(f"{tsv or f'{src} / {tgt}'}: no pair survived cleaning")
    return _Cleaned(cleaner, all_src, all_tgt, values, keep)


def _first_occurrences(values: np.ndarray, lines: np.ndarray, cleaner: Cleaner,
                       first_file: Path, dedupe: bool) -> np.ndarray:
    """(N,) bool: False for an exact duplicate (an equal hash) of an earlier pair,
    counted with its line."""
    keep = np.ones(len(values), dtype=bool)
    if dedupe and len(values):
        order = np.argsort(values, kind="stable")
        repeated = np.flatnonzero(values[order][1:] == values[order][:-1]) + 1
        keep[order[repeated]] = False
        for index in np.sort(order[repeated]):
            cleaner.counts["duplicate"].add(f"{first_file}:{int(lines[index])}")
        cleaner.kept -= len(repeated)
    return keep


def _thresholds(cleaned: _Cleaned, previous, given: list[str], dev: int, test: int,
                out: Path) -> tuple[tuple[int, int], list[str]]:
    """The split's hash thresholds: the earlier import's, or the N-th smallest hashes of
    this one -> (dev_below, test_below), and what the report says about them."""
    if previous is not None and previous[1] == given and len(given) < 2:
        return previous[0], [f"split: the thresholds of the earlier import into {out} "
                             f"(corpus.json), so no pair moves between splits; --resplit to "
                             f"draw anew"]
    notes = []
    if previous is not None and len(given) < 2:
        notes.append(f"split: drawn anew: the earlier import into {out} took "
                     f"{_given(previous[1])}, this one {_given(given)}")
    held = dev + test
    unique = cleaned.hashes[cleaned.keep]
    if held >= len(unique):
        raise CorpusError(f"--dev {dev} --test {test}: only {len(unique)} pairs survived "
                          f"cleaning; hold out fewer")
    ordered = np.sort(unique)
    dev_below = int(ordered[dev]) if dev else 0
    test_below = int(ordered[held]) if held else dev_below
    return (dev_below, test_below), notes


def _write_splits(scratch: Path, languages: tuple[str, str], cleaned: _Cleaned,
                  thresholds: tuple[int, int], held_out: dict[str, list[tuple[str, str]]]
                  ) -> dict[str, int]:
    """Pass 2: each kept pair to its split's files (empty splits leave no files) -> sizes."""
    splits = ("train", "dev", "test")
    paths = {name: tuple(scratch / f"{name}.{language}" for language in languages)
             for name in splits}
    sizes = dict.fromkeys(splits, 0)
    with contextlib.ExitStack() as stack:
        handles = {name: tuple(stack.enter_context(open(p, "w", encoding="utf-8", newline="\n"))
                               for p in paths[name]) for name in splits}
        s_in = stack.enter_context(open(cleaned.all_src, encoding="utf-8", newline="\n"))
        t_in = stack.enter_context(open(cleaned.all_tgt, encoding="utf-8", newline="\n"))
        for key, kept, s, t in zip(cleaned.hashes, cleaned.keep, s_in, t_in):
            if kept:
                name = split_of(int(key), *thresholds)
                handles[name][0].write(s)
                handles[name][1].write(t)
                sizes[name] += 1
        for name, pairs in held_out.items():
            for s, t in pairs:
                handles[name][0].write(s + "\n")
                handles[name][1].write(t + "\n")
            sizes[name] += len(pairs)
    cleaned.all_src.unlink()
    cleaned.all_tgt.unlink()
    for name in splits:
        if not sizes[name]:
            for path in paths[name]:
                path.unlink()
    if not sizes["train"]:
        raise CorpusError("no pair is left for training")
    return sizes


def _given(names: list[str]) -> str:
    return f"{' and '.join(names)} from files" if names else "dev and test by hash"


def _disabled(progress: bool | None) -> bool | None:
    """tqdm's disable: None shows bars only on a terminal."""
    return None if progress is None else not progress


def _previous_split(out: Path, resplit: bool) -> tuple[tuple[int, int], list[str]] | None:
    """The thresholds of an earlier import into out and the splits it took from given
    files; out must be absent, empty, or such an import (which this one replaces). The
    thresholds are reused only by an import that holds out the same way."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise CorpusError(f"--out {out}: exists and is not a directory")
    if not any(out.iterdir()):
        return None
    metadata = out / METADATA
    try:
        values = json.loads(metadata.read_text(encoding="utf-8"))
        split = values["import"]["split"]
        if split["scheme"] != SPLIT_SCHEME:
            raise KeyError("scheme")
        thresholds = int(split["dev_below"]), int(split["test_below"])
    except (OSError, ValueError, KeyError, TypeError):
        raise CorpusError(f"--out {out}: not empty and not a corpus made by `transduce data "
                          f"import` (no readable {METADATA} with its split); choose another "
                          f"directory, or empty this one") from None
    return None if resplit else (thresholds, sorted(split.get("given_files", [])))


class _Growing:
    """A growing numpy array of one dtype (amortised doubling)."""

    def __init__(self, dtype) -> None:
        self._data = np.empty(1 << 16, dtype=dtype)
        self._size = 0

    def append(self, value: int) -> None:
        if self._size == len(self._data):
            self._data = np.resize(self._data, 2 * len(self._data))
        self._data[self._size] = value
        self._size += 1

    def __len__(self) -> int:
        return self._size

    def array(self) -> np.ndarray:
        return self._data[:self._size]
