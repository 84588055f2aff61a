"""The token store: a split tokenised once, on disk, read as needed, for corpora larger
than memory.

`transduce data tokenize --data DIR` streams the training split through SentencePiece in
parallel worker processes (each side through its own model where the targets have one)
and writes DIR/tokens/train/:

    src.bin, tgt.bin            every pair's ids, one after the other (uint16 when the
                                vocabulary has at most 65,536 pieces, else uint32)
    src.offsets, tgt.offsets    int64 (pairs + 1,): pair i is ids[offsets[i]:offsets[i+1]]
    lines                       uint32 (pairs,): the pair's 1-based line in the text files
    store.json                  format, dtype, pair count, the tokenizer's fingerprint, and
                                the size and modification time of the files it was made from

(a text corpus, for language models, has only the tgt side). The pairs are exactly
load_split's: lines stripped, pairs with an empty side left out (counted), invalid UTF-8
or a NUL byte an error naming file and line. The directory is written under a temporary
name and renamed into place (transduce.atomic): it is complete or absent.

Reading it (StoredIds) opens the files (FileArray: positioned reads, not a map, whose
page faults would make the process resident in 64 KiB around every pair it reads);
batching reads the offsets only (lengths, a chunk at a time), and a batch's ids are
read when it is collated, so a process reads only the ids of the batches it trains
on, and they stay in the page cache, outside its resident memory. Memory
grows with the pairs by the batcher's narrow index (data/order.py: int16 lengths, int32
rows and orders), never with the corpus's tokens. load_split reads the store when it
exists and matches the tokenizer and the text files; a store made from other files or
another vocabulary is an error saying how to rebuild it, never silently used.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from transduce import atomic
from transduce.data.corpus import CorpusError, corpus_kind, split_files, text_file
from transduce.data.importer import raw_lines
from transduce.data.order import CHUNK as READ_CHUNK, gather, index_dtype
from transduce.errors import not_there

STORE_DIR = "tokens"
FORMAT = 1
CHUNK = 4096   # pairs per worker task


def store_path(data_dir: Path | str, split: str) -> Path:
    return Path(data_dir) / STORE_DIR / split


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _text_files(data_dir: Path, split: str) -> tuple[Path, ...]:
    """The split's files, one per side: (source, target), or (text,) for a text corpus."""
    if corpus_kind(data_dir) == "text":
        return (text_file(data_dir, split),)
    return split_files(data_dir, split)


def _stamp(path: Path) -> dict:
    info = path.stat()
    return {"path": path.name, "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def _decode(path: Path, number: int, raw: bytes) -> str:
    """A line's text, with read_lines's errors (NUL, invalid UTF-8) and its stripping."""
    nul = raw.find(b"\0")
    if nul >= 0:
        raise CorpusError(f"{path}:{number}: NUL byte at column {nul + 1}")
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CorpusError(f"{path}:{number}: invalid UTF-8 at byte {error.start + 1} of the "
                          f"line ({raw[error.start:error.start + 4]!r})") from None


def aligned_raw_rows(files: Sequence[Path]) -> Iterator[tuple[int, tuple[bytes, ...]]]:
    """(line number, raw line of every file), streamed. Different line counts are an
    error naming the file and line."""
    readers = [raw_lines(path) for path in files]
    while True:
        rows = [next(reader, None) for reader in readers]
        if all(row is None for row in rows):
            return
        if any(row is None for row in rows):
            ended = [path for path, row in zip(files, rows) if row is None]
            path, row = next((path, row) for path, row in zip(files, rows) if row is not None)
            raise CorpusError(f"{path}:{row[0]}: {ended[0]} ends after line {row[0] - 1} but "
                              f"{path} goes on: the files are not line-aligned")
        yield rows[0][0], tuple(row[1] for row in rows)


def stream_rows(files: Sequence[Path]) -> Iterator[tuple[int, tuple[str, ...]]]:
    """(line number, stripped texts) of every line (pair), streamed; errors as
    read_lines's (NUL, invalid UTF-8) and aligned_raw_rows's name file and line."""
    for number, raws in aligned_raw_rows(files):
        yield number, tuple(_decode(path, number, raw) for path, raw in zip(files, raws))


# Workers ------------------------------------------------------------------------------

_processors: list = []          # SentencePiece processors: one per side, or one for both


_start_error: str | None = None


def _start_worker(model_paths: tuple[str, ...]) -> None:
    """A worker's set-up. It must not raise: multiprocessing replaces a worker whose
    initializer fails, forever; the error is raised by the worker's first task instead."""
    global _processors, _start_error
    _processors, _start_error = [], None
    for model_path in model_paths:
        try:
            import sentencepiece as spm
            _processors.append(spm.SentencePieceProcessor(model_file=model_path))
        except Exception as error:   # noqa: BLE001 - reported by _encode_chunk
            _start_error = f"{model_path}: a tokenising worker cannot load it ({error})"
            return


@dataclass
class _Chunk:
    """Consecutive raw lines of every file, from line `first` on."""

    files: tuple[Path, ...]
    first: int
    raws: list[tuple[bytes, ...]]
    dtype: np.dtype


def _encode_chunk(chunk: _Chunk) -> tuple[np.ndarray, int, list[tuple[bytes, np.ndarray]]]:
    """A chunk's lines -> (line numbers kept, lines skipped for an empty side, and per
    side: its ids as bytes of dtype and their lengths). Decoding happens here, in the
    worker, with read_lines's errors naming file and line."""
    if _start_error is not None:
        raise CorpusError(_start_error)
    kept, columns = [], [[] for _ in chunk.files]
    for offset, raws in enumerate(chunk.raws):
        number = chunk.first + offset
        texts = [_decode(path, number, raw) for path, raw in zip(chunk.files, raws)]
        if all(texts):
            kept.append(number)
            for column, text in zip(columns, texts):
                column.append(text)
    encoded = []
    for side, texts in enumerate(columns):
        processor = _processors[min(side, len(_processors) - 1)]
        ids = processor.encode(texts, out_type=int, num_threads=1) if texts else []
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=chunk.dtype,
                           count=int(lengths.sum()))
        encoded.append((flat.tobytes(), lengths))
    return np.asarray(kept, dtype=np.uint32), len(chunk.raws) - len(kept), encoded


@dataclass
class BuildResult:
    path: Path
    pairs: int
    tokens: tuple[int, ...]
    skipped_empty: int
    dtype: str


def build_store(data_dir: Path | str, split: str, model_path: Path, vocab_size: int,
                fingerprint: str, *, target_model: Path | None = None, workers: int = 0,
                progress: bool | None = None) -> BuildResult:
    """Tokenise the split into its store (see the module's notes). target_model: the
    targets' SentencePiece model where it is not model_path's (a separate vocabulary;
    vocab_size is then the larger one's). workers: processes encoding in parallel (0:
    one per CPU, at most 8; 1: none, in this process)."""
    from tqdm import tqdm

    data_dir = Path(data_dir)
    files = _text_files(data_dir, split)
    for path in files:
        if not path.is_file():
            raise CorpusError(not_there(path))
    sides = ("src", "tgt") if len(files) == 2 else ("tgt",)
    dtype = token_dtype(vocab_size)
    workers = workers or min(8, os.cpu_count() or 1)
    skipped = pairs = 0
    totals = [0] * len(sides)
    files = tuple(files)
    with atomic.atomic_directory(store_path(data_dir, split)) as scratch, \
            contextlib.ExitStack() as stack:
        lines = stack.enter_context(contextlib.closing(_Appender(scratch / "lines", np.uint32)))
        ids = [stack.enter_context(open(scratch / f"{side}.bin", "wb")) for side in sides]
        offsets = [stack.enter_context(contextlib.closing(
            _Appender(scratch / f"{side}.offsets", np.int64))) for side in sides]
        for appender in offsets:
            appender.extend(np.zeros(1, dtype=np.int64))
        bar = stack.enter_context(tqdm(desc=f"tokenising {split}", unit=" lines",
                                       unit_scale=True,
                                       disable=None if progress is None else not progress))
        models = (model_path,) if target_model is None else (model_path, target_model)
        results = stack.enter_context(_encoded(_chunks(files, dtype), workers, models))
        for numbers, empty, encoded in results:
            lines.extend(numbers)
            pairs += len(numbers)
            skipped += empty
            bar.update(len(numbers) + empty)
            for k, (flat, lengths) in enumerate(encoded):
                ids[k].write(flat)
                offsets[k].extend(totals[k] + np.cumsum(lengths))
                totals[k] += int(lengths.sum())
        stack.close()
        if not pairs:
            raise CorpusError(f"{' / '.join(map(str, files))}: no line has text"
                              f"{' on both sides' if len(files) == 2 else ''}")
        metadata = {"format": FORMAT, "sides": list(sides), "dtype": dtype.name,
                    "pairs": pairs, "tokens": totals, "skipped_empty": skipped,
                    "tokenizer": fingerprint, "files": [_stamp(p) for p in files]}
        (scratch / "store.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return BuildResult(store_path(data_dir, split), pairs, tuple(totals), skipped, dtype.name)


def _chunks(files: tuple[Path, ...], dtype) -> Iterator[_Chunk]:
    """The raw rows, CHUNK at a time. Pool.imap reads this in its task thread: only raw
    lines here, the decoding and every per-line step are the workers'."""
    raws: list[tuple[bytes, ...]] = []
    first = 1
    for number, row in aligned_raw_rows(files):
        if not raws:
            first = number
        raws.append(row)
        if len(raws) == CHUNK:
            yield _Chunk(files, first, raws, dtype)
            raws = []
    if raws:
        yield _Chunk(files, first, raws, dtype)


@contextlib.contextmanager
def _encoded(chunks: Iterator[_Chunk], workers: int, model_paths: tuple[Path, ...]):
    """The chunks encoded in order, by `workers` processes (1: in this one); on an error
    the workers are stopped at once, else joined."""
    paths = tuple(map(str, model_paths))
    if workers == 1:
        _start_worker(paths)
        yield map(_encode_chunk, chunks)
        return
    pool = multiprocessing.get_context("spawn").Pool(
        workers, initializer=_start_worker, initargs=(paths,))
    try:
        yield pool.imap(_encode_chunk, chunks)
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


class _Appender:
    """A raw array file written in pieces (read back as a FileArray)."""

    def __init__(self, path: Path, dtype) -> None:
        self.handle, self.dtype = open(path, "wb"), np.dtype(dtype)

    def extend(self, values: np.ndarray) -> None:
        self.handle.write(np.asarray(values, dtype=self.dtype).tobytes())

    def close(self) -> None:
        self.handle.close()


# Reading ------------------------------------------------------------------------------

class FileArray:
    """A 1-D array in a raw file, read with positioned reads (os.pread), not mapped.

    Why not np.memmap: a page fault on a mapped file maps the neighbouring cached pages
    too (the kernel's fault-around, 64 KiB), so each pair a batch reads from a map made
    the process's resident set grow by up to 64 KiB a side, about 0.4 GB over 30 steps
    at 5 million pairs (docs/scaling.md); read pages stay in the page cache, outside the
    process."""

    def __init__(self, path: Path, dtype) -> None:
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self._fd = os.open(self.path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        if size % self.dtype.itemsize:
            os.close(self._fd)
            self._fd = None
            raise ValueError(f"{size} bytes is not a whole number of {self.dtype.name}")
        self._length = size // self.dtype.itemsize

    def __len__(self) -> int:
        return self._length

    def read(self, start: int, stop: int) -> np.ndarray:
        """Items [start, stop) -> (stop - start,) of dtype, read-only."""
        count = max(0, stop - start) * self.dtype.itemsize
        data = os.pread(self._fd, count, start * self.dtype.itemsize)
        if len(data) != count:
            raise CorpusError(f"{self.path}: {len(data)} bytes where {count} were expected "
                              f"at item {start}: the file shrank")
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self._length)
            if step != 1:
                raise TypeError("a FileArray is sliced with step 1 only")
            return self.read(start, stop)
        if isinstance(key, np.ndarray):             # fancy indexing: messages and tests
            return np.asarray(self)[key]
        index = int(key) + (self._length if int(key) < 0 else 0)
        if not 0 <= index < self._length:
            raise IndexError(key)
        return self.read(index, index + 1)[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.read(0, self._length), dtype=dtype)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class StoredIds(Sequence):
    """One side of a stored split as a sequence of id arrays, read lazily from its files
    (FileArray; any sliceable array works).
    `lengths` (ids per item, without specials) comes from the offsets alone; `take`
    narrows it to some items (the length filter) without reading any ids."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, rows: np.ndarray | None = None):
        self.tokens, self.offsets, self.rows = tokens, offsets, rows

    @property
    def lengths(self) -> np.ndarray:
        """(items,) int32, computed from the offsets at each call, never kept: the
        batcher keeps its own (narrower) copy, and a second would cost bytes a pair."""
        every = _offset_diffs(self.offsets)
        return every if self.rows is None else gather(every, self.rows)

    def __len__(self) -> int:
        return len(self.offsets) - 1 if self.rows is None else len(self.rows)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("StoredIds is indexed one item at a time (or narrowed with take)")
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index = int(index) % len(self)
        row = index if self.rows is None else int(self.rows[index])
        start, stop = (int(x) for x in self.offsets[row:row + 2])
        return np.asarray(self.tokens[start:stop], dtype=np.int64)

    def take(self, indices: np.ndarray) -> "StoredIds":
        """The items `indices` (n,) (int32 below 2^31 pairs: pass that, and sides taken
        with the same array share it)."""
        indices = np.asarray(indices, dtype=index_dtype(len(self.offsets)))
        rows = indices if self.rows is None else self.rows[indices]
        return StoredIds(self.tokens, self.offsets, rows)


def _offset_diffs(offsets: np.ndarray) -> np.ndarray:
    """offsets (n + 1,) int64 -> (n,) int32 lengths, read a chunk at a time."""
    count = len(offsets) - 1
    lengths = np.empty(max(count, 0), dtype=np.int32)
    for start in range(0, count, READ_CHUNK):
        stop = min(start + READ_CHUNK, count)
        chunk = np.asarray(offsets[start:stop + 1])
        np.subtract(chunk[1:], chunk[:-1], out=lengths[start:stop], casting="unsafe")
    return lengths


class TakenLines(Sequence):
    """The line numbers of some stored items, read from the file when asked (a message
    names a line): nothing copies them all, 4 bytes a pair."""

    def __init__(self, lines: np.ndarray, rows: np.ndarray):
        self.lines, self.rows = lines, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):  # type: ignore[override]
        return int(self.lines[self.rows[index]])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.lines[self.rows], dtype=dtype)


@dataclass
class TokenStore:
    """An opened store: its sides, line numbers and metadata."""

    path: Path
    sides: dict[str, StoredIds]
    line_numbers: FileArray        # (pairs,) uint32, read on demand
    metadata: dict

    def __len__(self) -> int:
        return len(self.line_numbers)

    def summary(self) -> str:
        text = f"{self.path}: {len(self)} {'pairs' if 'src' in self.sides else 'lines'} " \
               f"(token store, {self.metadata['dtype']})"
        if self.metadata["skipped_empty"]:
            text += f"; dropped {self.metadata['skipped_empty']} with an empty side"
        return text


def open_store(data_dir: Path | str, split: str, fingerprint: str) -> TokenStore | None:
    """The split's store, or None when there is none. A store made by another vocabulary
    or from text files that have changed since is an error saying how to rebuild it."""
    data_dir = Path(data_dir)
    path = store_path(data_dir, split)
    if not (path / "store.json").is_file():
        return None
    rebuild = f"rebuild it with `transduce data tokenize --data {data_dir}` (or delete {path})"
    try:
        metadata = json.loads((path / "store.json").read_text(encoding="utf-8"))
        if metadata["format"] != FORMAT:
            raise CorpusError(f"{path}: store format {metadata['format']}, this version reads "
                              f"{FORMAT}; {rebuild}")
        dtype = np.dtype(metadata["dtype"])
        sides, stamps = metadata["sides"], metadata["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorpusError(f"{path}/store.json: unreadable ({error}); {rebuild}") from None
    if metadata["tokenizer"] != fingerprint:
        raise CorpusError(f"{path}: tokenised with another vocabulary (fingerprint "
                          f"{metadata['tokenizer']}, the one read is {fingerprint}: the "
                          f"corpus's spm.model, or the tokenizer.json of the checkpoint "
                          f"trained on); {rebuild}")
    files = _text_files(data_dir, split)
    for stamp, file in zip(stamps, files):
        if not file.is_file() or _stamp(file) != stamp:
            raise CorpusError(f"{path}: made from {stamp['path']} as it was before it "
                              f"changed (size or modification time differ); {rebuild}")
    opened = {}
    pairs = int(metadata["pairs"])
    for side in sides:
        try:
            offsets = FileArray(path / f"{side}.offsets", np.int64)
            total = int(offsets[-1]) if len(offsets) else -1
            tokens = FileArray(path / f"{side}.bin", dtype)
        except (OSError, ValueError) as error:
            raise CorpusError(f"{path}/{side}: cannot read ({error}); {rebuild}") from None
        if len(offsets) != pairs + 1 or len(tokens) != total:
            raise CorpusError(f"{path}/{side}: {len(offsets) - 1} pairs and {len(tokens)} ids, "
                              f"store.json says {pairs} and {total}: damaged; {rebuild}")
        opened[side] = StoredIds(tokens, offsets)
    try:
        lines = FileArray(path / "lines", np.uint32)
    except (OSError, ValueError) as error:
        raise CorpusError(f"{path}/lines: cannot read ({error}); {rebuild}") from None
    if len(lines) != pairs:
        raise CorpusError(f"{path}/lines: {len(lines)} entries, expected {pairs}; {rebuild}")
    return TokenStore(path, opened, lines, metadata)


@dataclass
class Sample:
    pairs: list[tuple[str, ...]]   # in file order
    seen: int                      # pairs with text on every side


def sample_pairs(files: Sequence[Path], size: int, seed: int) -> Sample:
    """`size` pairs (lines) with text on every side, drawn uniformly in one streamed pass
    (reservoir sampling, Vitter's algorithm R, seeded): memory holds `size` pairs."""
    import random

    rng = random.Random(seed)
    reservoir: list[tuple[int, tuple[str, ...]]] = []
    seen = 0
    for number, texts in stream_rows(files):
        if not all(texts):
            continue
        seen += 1
        if len(reservoir) < size:
            reservoir.append((number, texts))
        else:
            slot = rng.randrange(seen)
            if slot < size:
                reservoir[slot] = (number, texts)
    if not seen:
        raise CorpusError(f"{' / '.join(map(str, files))}: no line has text on every side")
    reservoir.sort()
    return Sample([texts for _, texts in reservoir], seen)
