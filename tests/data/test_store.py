"""The token store: the same pairs, ids and batches as the in-memory path; lazy reads
(batching touches lengths only, a process reads only the batches it collates); staleness
and bad input named; `transduce vocab --sample` and `transduce data tokenize`."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from transduce.cli import main
from transduce.data.batching import TokenBatcher
from transduce.data.corpus import CorpusError, read_split
from transduce.data.dataset import load_split
from transduce.data.store import (FileArray, StoredIds, build_store, open_store, sample_pairs,
                                   token_dtype)
from transduce.data.tokenizer import MODEL_NAME, Tokenizer

REPO = Path(__file__).resolve().parents[2]
BIBLE = REPO / "data" / "bible"


def copy_corpus(source: Path, destination: Path) -> Path:
    destination.mkdir()
    for name in ("corpus.json", MODEL_NAME, "train.es", "train.en", "dev.es", "dev.en"):
        shutil.copy(source / name, destination / name)
    return destination


def tokenize(directory: Path, workers: int = 1, vocab_size: int | None = None):
    tokenizer = Tokenizer(directory / MODEL_NAME)
    return build_store(directory, "train", tokenizer.path, vocab_size or tokenizer.vocab_size,
                       tokenizer.fingerprint, workers=workers, progress=False)


def assert_same_split_and_batches(directory: Path, max_len: int, max_tokens: int,
                                  epochs=(0, 1), collated: int | None = None):
    tokenizer = Tokenizer(directory / MODEL_NAME)
    stored = load_split(directory, "train", tokenizer, max_len)
    assert isinstance(stored.src_ids, StoredIds)
    shutil.move(directory / "tokens", directory / "aside")
    memory = load_split(directory, "train", tokenizer, max_len)
    shutil.move(directory / "aside", directory / "tokens")
    assert not isinstance(memory.src_ids, StoredIds)
    assert len(stored.src_ids) == len(memory.src_ids)
    assert list(np.asarray(stored.line_numbers)) == list(memory.line_numbers)
    assert stored.report[1:] == memory.report[1:]          # the length filter's report
    a = TokenBatcher(stored.src_ids, stored.tgt_ids, max_tokens, seed=3,
                     line_numbers=stored.line_numbers)
    b = TokenBatcher(memory.src_ids, memory.tgt_ids, max_tokens, seed=3,
                     line_numbers=memory.line_numbers)
    for epoch in epochs:
        batches_a, batches_b = a.epoch_batches(epoch), b.epoch_batches(epoch)
        assert len(batches_a) == len(batches_b)
        assert all(np.array_equal(x, y) for x, y in zip(batches_a, batches_b))
        for indices in batches_a[:collated]:
            x, y = a.collate(indices), b.collate(indices)
            for field in ("src", "tgt_in", "tgt_out", "src_lengths", "tgt_lengths", "indices"):
                assert getattr(x, field).equal(getattr(y, field)), field
            assert a.target_tokens(indices) == b.target_tokens(indices)
    return stored, memory


def test_the_store_gives_the_in_memory_pairs_ids_and_batches(tiny_corpus, tmp_path):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    # lines that read_split drops (an empty side) and strips: the store must agree
    with open(directory / "train.es", "a", encoding="utf-8") as handle:
        handle.write("\n  casa roja  \n" + "uno dos " * 30 + "\n")
    with open(directory / "train.en", "a", encoding="utf-8") as handle:
        handle.write("only target\n red house\r\n" + "one two " * 30 + "\n")
    result = tokenize(directory, workers=2)
    assert result.skipped_empty == 1 and result.pairs == 302 and result.dtype == "uint16"
    stored, memory = assert_same_split_and_batches(directory, max_len=20, max_tokens=200)
    assert "of 302 pairs longer than 20 tokens; the longest is line 303" in stored.report[1]
    assert 0 < len(stored.src_ids) < 302
    assert "dropped 1 with an empty side" in stored.report[0]


@pytest.mark.skipif(not (BIBLE / MODEL_NAME).is_file() or not (BIBLE / "train.es").is_file(),
                    reason="no Bible corpus in data/bible (`transduce data bible` and "
                           "`transduce vocab`)")
def test_identical_batches_to_the_in_memory_path_on_the_bible(tmp_path):
    directory = copy_corpus(BIBLE, tmp_path / "bible")
    result = tokenize(directory, workers=2)
    assert result.pairs == 29084 and result.dtype == "uint16"
    stored, _ = assert_same_split_and_batches(directory, max_len=256, max_tokens=4096,
                                              epochs=(0,), collated=None)
    assert len(stored.src_ids) == len(read_split(directory, "train"))


def test_wide_vocabularies_are_stored_as_uint32(tiny_corpus, tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    assert tokenize(directory, vocab_size=70000).dtype == "uint32"
    assert (directory / "tokens" / "train" / "src.bin").stat().st_size == \
        4 * json.loads((directory / "tokens/train/store.json").read_text())["tokens"][0]
    assert_same_split_and_batches(directory, max_len=256, max_tokens=200, epochs=(0,))


class RecordingTokens:
    """Stands for the stored ids: records which spans a process reads."""

    def __init__(self, tokens):
        self.tokens, self.read = tokens, []

    def __getitem__(self, key):
        self.read.append((key.start, key.stop))
        return self.tokens[key]

    def __len__(self):
        return len(self.tokens)


def test_batching_reads_lengths_only_and_each_process_reads_only_its_batches(tiny_corpus,
                                                                             tmp_path):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    tokenize(directory)
    opened = open_store(directory, "train", Tokenizer(directory / MODEL_NAME).fingerprint)
    sides = {}
    for side, ids in opened.sides.items():
        sides[side] = StoredIds(RecordingTokens(ids.tokens), ids.offsets)
    batcher = TokenBatcher(sides["src"], sides["tgt"], 200, seed=1)
    batches = batcher.epoch_batches(0)
    sum(batcher.target_tokens(b) for b in batches)
    batcher.padding_fraction(0)
    assert not sides["src"].tokens.read and not sides["tgt"].tokens.read
    # The training loop's sharding: a step takes world * update_freq batches, and rank r
    # collates its update_freq of them (train/loop.py).
    world, rank = 2, 1
    mine = [b for position, b in enumerate(batches) if position % world == rank]
    for indices in mine:
        batcher.collate(indices)
    offsets = opened.sides["src"].offsets
    expected = sorted((int(offsets[i]), int(offsets[i + 1])) for b in mine for i in b)
    assert sorted(sides["src"].tokens.read) == expected
    assert len(expected) < len(offsets) - 1


def test_a_changed_corpus_or_vocabulary_is_refused_with_the_command_to_rebuild(tiny_corpus,
                                                                               tmp_path):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    tokenize(directory)
    tokenizer = Tokenizer(directory / MODEL_NAME)
    with pytest.raises(CorpusError, match="another vocabulary.*`transduce data tokenize --data"):
        load_split(directory, "train", type("T", (), {"fingerprint": "0" * 16})(), 256)
    with open(directory / "train.en", "a", encoding="utf-8") as handle:
        handle.write("")
    load_split(directory, "train", tokenizer, 256)           # untouched content: still fine
    with open(directory / "train.en", "a", encoding="utf-8") as handle:
        handle.write("changed\n")
    with open(directory / "train.es", "a", encoding="utf-8") as handle:
        handle.write("cambiado\n")
    with pytest.raises(CorpusError, match=r"train\.es as it was before it changed.*"
                                          r"transduce data tokenize --data"):
        load_split(directory, "train", tokenizer, 256)
    (directory / "tokens" / "train" / "tgt.offsets").write_bytes(b"\0" * 16)
    tokenize(directory)                                       # a rebuild replaces it whole
    load_split(directory, "train", tokenizer, 256)


def test_a_damaged_store_is_named(tiny_corpus, tmp_path):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    tokenize(directory)
    path = directory / "tokens" / "train" / "tgt.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(CorpusError, match=r"tgt: 300 pairs and \d+ ids, store.json says .*damaged"):
        open_store(directory, "train", Tokenizer(directory / MODEL_NAME).fingerprint)


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_text_is_named_by_file_and_line_and_leaves_no_store(tiny_corpus, tmp_path, workers):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    lines = (directory / "train.es").read_bytes().split(b"\n")
    lines[199] = b"caf\xe9"
    lines[249] = b"\xff"         # the first bad line is named
    (directory / "train.es").write_bytes(b"\n".join(lines))
    with pytest.raises(CorpusError, match=rf"{directory / 'train.es'}:200: invalid UTF-8 at byte 4"):
        tokenize(directory, workers=workers)
    assert not (directory / "tokens" / "train").exists()
    assert not [p for p in (directory / "tokens").iterdir()]


def test_unaligned_files_are_refused(tiny_corpus, tmp_path):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    with open(directory / "train.en", "a", encoding="utf-8") as handle:
        handle.write("one more\n")
    with pytest.raises(CorpusError, match=r"train\.en:301: .*train\.es ends after line 300"):
        tokenize(directory)


def test_sampling_is_uniform_seeded_and_bounded(tmp_path):
    src, tgt = tmp_path / "a.es", tmp_path / "a.en"
    src.write_text("".join(f"s{i}\n" if i % 10 else "\n" for i in range(2000)))
    tgt.write_text("".join(f"t{i}\n" for i in range(2000)))
    one = sample_pairs((src, tgt), 300, seed=4)
    assert one.seen == 1800 and len(one.pairs) == 300
    assert one.pairs == sample_pairs((src, tgt), 300, seed=4).pairs
    assert one.pairs != sample_pairs((src, tgt), 300, seed=5).pairs
    numbers = [int(s[1:]) for s, _ in one.pairs]
    assert numbers == sorted(numbers) and all(s[1:] == t[1:] for s, t in one.pairs)
    assert 600 < np.mean(numbers) < 1400     # drawn from the whole file, not its head
    assert len(sample_pairs((src, tgt), 5000, seed=1).pairs) == 1800


def test_cli_vocab_sample_and_tokenize(tiny_corpus, tmp_path, capsys):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    (directory / MODEL_NAME).unlink()
    assert main(["vocab", "--data", str(directory), "--size", "290", "--sample", "120"]) == 0
    printed = capsys.readouterr().out
    assert "sampled 120 of 300 pairs" in printed and "round trip exact for 240 of 240" in printed
    assert Tokenizer(directory / MODEL_NAME).vocab_size == 290
    assert main(["data", "tokenize", "--data", str(directory), "--workers", "1"]) == 0
    assert "300 pairs" in capsys.readouterr().out and (directory / "tokens/train").is_dir()
    assert main(["data", "stats", "--data", str(directory)]) == 0
    assert "token store, uint16" in capsys.readouterr().out


def test_a_text_corpus_is_sampled_and_stored_on_one_side(tmp_path, capsys):
    directory = tmp_path / "text"
    directory.mkdir()
    (directory / "train.txt").write_text("uno dos\n\ntres cuatro\n", encoding="utf-8")
    from transduce.data.tokenizer import train_tokenizer
    train_tokenizer(["uno dos", "tres cuatro"] * 20, directory, 280)
    result = tokenize(directory)
    assert result.pairs == 2 and result.skipped_empty == 1 and len(result.tokens) == 1
    opened = open_store(directory, "train", Tokenizer(directory / MODEL_NAME).fingerprint)
    assert list(opened.sides) == ["tgt"] and list(opened.line_numbers) == [1, 3]
    tokenizer = Tokenizer(directory / MODEL_NAME)
    assert main(["vocab", "--data", str(directory), "--size", "280", "--sample", "1"]) == 0
    assert "sampled 1 of 2 lines with text" in capsys.readouterr().out
    tokenizer = Tokenizer(directory / MODEL_NAME)
    tokenize(directory)
    opened = open_store(directory, "train", tokenizer.fingerprint)
    assert [list(opened.sides["tgt"][i]) for i in range(2)] == \
        tokenizer.encode(["uno dos", "tres cuatro"])
    assert list(opened.sides["tgt"][-1]) == list(opened.sides["tgt"][1])
    from transduce.data.dataset import load_text_split
    split = load_text_split(directory, "train", tokenizer, 256)
    assert isinstance(split.ids, StoredIds) and list(split.line_numbers) == [1, 3]
    assert "(token store, uint16)" in split.report[0]


def test_tokenising_shows_a_progress_bar_with_lines_per_second(tiny_corpus, tmp_path, capsys):
    directory = copy_corpus(tiny_corpus, tmp_path / "corpus")
    tokenizer = Tokenizer(directory / MODEL_NAME)
    build_store(directory, "train", tokenizer.path, tokenizer.vocab_size,
                tokenizer.fingerprint, workers=1, progress=True)
    shown = capsys.readouterr().err
    assert "tokenising train" in shown and "lines/s" in shown and "300" in shown


def resident_file_bytes() -> int | None:
    """This process's resident pages of files (Linux), None elsewhere."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((x for x in status.splitlines() if x.startswith("RssFile:")), None)
    return None if line is None else int(line.split()[1]) * 1024


def test_file_arrays_read_by_position_and_leave_nothing_resident(tmp_path):
    np.arange(3_000_000, dtype=np.int64).tofile(tmp_path / "a")          # 24 MB
    array = FileArray(tmp_path / "a", np.int64)
    assert len(array) == 3_000_000 and array[5] == 5 and array[-1] == 2_999_999
    assert array[10:14].tolist() == [10, 11, 12, 13] and array[5:2].tolist() == []
    assert array[np.array([3, 1])].tolist() == [3, 1]
    with pytest.raises(IndexError):
        array[3_000_000]
    with pytest.raises(TypeError, match="step 1"):
        array[::2]
    before = resident_file_bytes()
    for start in np.random.default_rng(0).integers(0, 2_999_000, 2000):
        array[start:start + 40]                 # a mapped file would grow by ~64 KiB each
    if before is not None:
        assert resident_file_bytes() - before < 2 << 20
    (tmp_path / "b").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match="whole number of int64"):
        FileArray(tmp_path / "b", np.int64)
    with open(tmp_path / "a", "r+b") as handle:
        handle.truncate(800)
    with pytest.raises(CorpusError, match=r"a: 0 bytes where 320 were expected at item "
                                          r"1000: the file shrank"):
        array[1000:1040]
