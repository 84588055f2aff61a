"""A split ready for training or evaluation: validated, tokenised (cached), filtered.

Three kinds: pairs of a parallel corpus (load_split), lines of a text corpus for a
language model or a masked LM (load_text_split), labelled lines of a classification
corpus (load_labelled_split)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transduce.data.batching import LengthFilter
from transduce.data.corpus import ParallelCorpus, TextCorpus, read_split, read_text_split
from transduce.data.labelled import LabelledCorpus, label_indices, labelled_file, read_labelled
from transduce.data.order import copy_as, index_dtype
from transduce.data.store import StoredIds, TakenLines, TokenStore, open_store
from transduce.data.tokenizer import Tokenizer

CACHE_DIR = ".cache"


@dataclass
class TokenizedSplit:
    corpus: ParallelCorpus
    src_ids: list[np.ndarray]
    tgt_ids: list[np.ndarray]
    line_numbers: list[int]
    report: list[str]


def load_split(data_dir: Path, split: str, tokenizer: Tokenizer,
               max_len: int | None = None) -> TokenizedSplit:
    """Pairs of a split as ids, the targets segmented by the tokenizer's target side (a
    separate target vocabulary, an imported Marian model's target.spm, else the one
    vocabulary); with max_len, pairs longer than it (specials included) are left out,
    counted in the report, never cropped. A split with a token store (`transduce data
    tokenize`, data/store.py) is read from it, ids read as batches need them."""
    stored = open_store(data_dir, split, tokenizer.fingerprint)
    if stored is not None and "src" in stored.sides:
        return _stored_split(stored, max_len)
    corpus = read_split(data_dir, split)
    cache = Path(data_dir) / CACHE_DIR
    src_ids = tokenizer.encode_cached(corpus.source, cache)
    tgt_ids = tokenizer.target_tokenizer.encode_cached(corpus.target, cache)
    lines, report = list(corpus.line_numbers), [corpus.summary()]
    if max_len is not None:
        kept = LengthFilter.apply(src_ids, tgt_ids, max_len)
        report.append(kept.report(src_ids, tgt_ids, lines, max_len))
        src_ids = [src_ids[i] for i in kept.kept]
        tgt_ids = [tgt_ids[i] for i in kept.kept]
        lines = [lines[i] for i in kept.kept]
    return TokenizedSplit(corpus, src_ids, tgt_ids, lines, report)


def _stored_split(stored: TokenStore, max_len: int | None) -> TokenizedSplit:
    """A split from its token store (data/store.py): the ids stay on disk, mapped; the
    length filter reads the offsets only. Its `corpus` is the store (no texts)."""
    src_ids, tgt_ids = stored.sides["src"], stored.sides["tgt"]
    lines, report = stored.line_numbers, [stored.summary()]
    if max_len is not None:
        kept = LengthFilter.apply(src_ids, tgt_ids, max_len)
        report.append(kept.report(src_ids, tgt_ids, lines, max_len))
        if len(kept.dropped):
            (src_ids, tgt_ids), lines = _take_kept((src_ids, tgt_ids), lines, kept.kept)
    return TokenizedSplit(stored, src_ids, tgt_ids, lines, report)  # type: ignore[arg-type]


def _take_kept(sides: tuple[StoredIds, ...], lines: np.ndarray, kept: np.ndarray
               ) -> tuple[tuple[StoredIds, ...], TakenLines]:
    """The stored sides and line numbers narrowed to the rows `kept` (n,), all sharing
    one int32 copy of them (4 bytes a pair), the line numbers left in their map."""
    rows = copy_as(kept, index_dtype(len(lines)))
    return tuple(side.take(rows) for side in sides), TakenLines(lines, rows)


@dataclass
class TokenizedText:
    """The lines of a text split as ids (no specials), with their line numbers."""

    corpus: TextCorpus
    ids: list[np.ndarray]
    line_numbers: list[int]
    report: list[str]


def load_text_split(data_dir: Path, split: str, tokenizer: Tokenizer,
                    max_len: int | None = None) -> TokenizedText:
    """Lines of a text split as ids; with max_len, lines longer than it (with their bos
    or eos) are left out, counted in the report, never cropped. Packed training reads
    the whole stream and passes no max_len: its blocks cross line boundaries. A split
    with a token store (data/store.py) is read from it: packing (GPT) and the encoder's
    items (BERT) read their ids from its files as they collate."""
    stored = open_store(data_dir, split, tokenizer.fingerprint)
    if stored is not None and list(stored.sides) == ["tgt"]:
        ids, lines, report = stored.sides["tgt"], stored.line_numbers, [stored.summary()]
        if max_len is not None:
            kept = LengthFilter.apply(None, ids, max_len)
            report.append(kept.report(None, ids, lines, max_len))
            if len(kept.dropped):
                (ids,), lines = _take_kept((ids,), lines, kept.kept)
        return TokenizedText(stored, ids, lines, report)  # type: ignore[arg-type]
    corpus = read_text_split(data_dir, split)
    ids = tokenizer.encode_cached(corpus.lines, Path(data_dir) / CACHE_DIR)
    lines, report = list(corpus.line_numbers), [corpus.summary()]
    if max_len is not None:
        kept = LengthFilter.apply(None, ids, max_len)
        report.append(kept.report(None, ids, lines, max_len))
        ids = [ids[i] for i in kept.kept]
        lines = [lines[i] for i in kept.kept]
    return TokenizedText(corpus, ids, lines, report)


@dataclass
class TokenizedLabelled:
    """The labelled lines of a classification split as ids (no specials), with their
    class indices (in `names`' order) and line numbers; second_ids the second text of
    each pair (None: single texts)."""

    corpus: LabelledCorpus
    ids: list[np.ndarray]
    labels: list[int]
    names: list[str]
    line_numbers: list[int]
    report: list[str]
    second_ids: list[np.ndarray] | None = None


def load_labelled_split(data_dir: Path, split: str, tokenizer: Tokenizer,
                        names: list[str]) -> TokenizedLabelled:
    """{split}.tsv as ids and class indices; a label not among `names` is an error
    naming file and line. Long texts are kept (the encoder batcher crops them)."""
    corpus = read_labelled(labelled_file(data_dir, split))
    labels = label_indices(corpus, names)
    ids = tokenizer.encode_cached(corpus.texts, Path(data_dir) / CACHE_DIR)
    second = None if corpus.seconds is None else \
        tokenizer.encode_cached(corpus.seconds, Path(data_dir) / CACHE_DIR)
    return TokenizedLabelled(corpus, ids, labels, names, list(corpus.line_numbers),
                             [corpus.summary()], second)
