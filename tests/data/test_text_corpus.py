"""Text corpora for language models: reading and validating {split}.txt, telling the
two kinds of corpus apart, lines batched without a source side, packed blocks, and the
commands (vocab, data stats) on a text corpus."""

import json

import numpy as np
import pytest
import torch

from transduce.cli import main
from transduce.data.batching import BatchingError, LengthFilter, PackedBatcher, TokenBatcher, \
    pack_stream
from transduce.data.corpus import CorpusError, corpus_kind, read_split, read_text, \
    read_text_split, write_metadata, write_text_metadata
from transduce.data.dataset import load_text_split
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_tokenizer


def write(path, data):
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def test_reads_lines_skipping_and_counting_empty_ones(tmp_path):
    text = read_text(write(tmp_path / "train.txt", " uno dos \n\n  \ntres\r\n"))
    assert text.lines == ["uno dos", "tres"] and text.line_numbers == [1, 4]
    assert text.dropped_empty == [2, 3]
    assert text.summary().endswith("train.txt: 2 lines; skipped 2 empty (lines 2, 3)")


@pytest.mark.parametrize("data,message", [
    (b"good\n\xff\xfebad\n", r"train.txt:2: invalid UTF-8 at byte 1"),
    (b"good\nfine\nba\x00d\n", r"train.txt:3: NUL byte at column 3"),
    (b"", r"train.txt: the file is empty"),
    (b"\n \n", r"train.txt: the file is empty"),
])
def test_bad_input_names_file_and_line(tmp_path, data, message):
    write(tmp_path / "train.txt", data)
    with pytest.raises(CorpusError, match=message):
        read_text_split(tmp_path, "train")


def test_the_kind_of_a_corpus_directory(tmp_path):
    write(tmp_path / "train.txt", "hello\n")
    assert corpus_kind(tmp_path) == "text"          # train.txt and no corpus.json
    with pytest.raises(CorpusError, match=r"is a text corpus .*\(--arch decoder\)"):
        read_split(tmp_path, "train")
    write_text_metadata(tmp_path, "en", module="x")
    assert json.loads((tmp_path / "corpus.json").read_text()) == \
        {"kind": "text", "language": "en", "module": "x"}
    assert corpus_kind(tmp_path) == "text"
    parallel = tmp_path / "parallel"
    parallel.mkdir()
    write(parallel / "train.es", "hola\n")
    write(parallel / "train.en", "hello\n")
    write_metadata(parallel, "es", "en")
    assert corpus_kind(parallel) == "parallel"
    with pytest.raises(CorpusError, match="is not a text corpus"):
        read_text_split(parallel, "train")
    write(parallel / "corpus.json", '{"kind": "images"}')
    with pytest.raises(CorpusError, match="corpus.json: \"kind\": 'images'"):
        corpus_kind(parallel)
    with pytest.raises(CorpusError, match="nowhere: no such corpus directory"):
        corpus_kind(tmp_path / "nowhere")
    with pytest.raises(CorpusError, match="corpus.json: a file, where a corpus directory was"):
        corpus_kind(parallel / "corpus.json")


def test_lines_batched_without_a_source_side():
    ids = [np.array([10, 11, 12]), np.array([20]), np.array([30, 31])]
    batcher = TokenBatcher(None, ids, 8, shuffle=False)
    batch = batcher.collate(np.array([0, 1]))
    assert batch.src.shape == (2, 0) and batch.src_lengths.tolist() == [0, 0]
    assert batch.tgt_in.tolist() == [[BOS_ID, 10, 11, 12], [BOS_ID, 20, PAD_ID, PAD_ID]]
    assert batch.tgt_out.tolist() == [[10, 11, 12, EOS_ID], [20, EOS_ID, PAD_ID, PAD_ID]]
    assert batcher.target_tokens(np.array([0, 1, 2])) == 4 + 2 + 3
    rng = np.random.default_rng(0)
    many = [rng.integers(4, 100, rng.integers(1, 40)) for _ in range(300)]
    batcher = TokenBatcher(None, many, 128, seed=3)
    seen = []
    for batch in batcher.iterate(epoch=1):
        assert batch.tgt_in.numel() <= 128
        seen.extend(batch.indices.tolist())
    assert sorted(seen) == list(range(300)) and batcher.padding_fraction() < 0.1
    many[5] = np.arange(4, 200)
    with pytest.raises(BatchingError, match=r"1 of 300 lines cannot fit .* \(line 6\)"):
        TokenBatcher(None, many, 128, line_numbers=list(range(1, 301)))


def test_length_filter_of_lines():
    ids = [np.arange(5), np.arange(50), np.arange(9)]
    kept = LengthFilter.apply(None, ids, max_len=10)
    assert kept.kept.tolist() == [0, 2]
    assert kept.report(None, ids, [3, 4, 5], 10) == \
        "filtered 1 of 3 lines longer than 10 tokens; the longest is line 4 with 51 tokens"
    with pytest.raises(BatchingError, match=r"^max_len=5: none of the 3 lines fits; the "
                                            r"shortest needs 6 tokens \(bos or eos included\)$"):
        LengthFilter.apply(None, ids, max_len=5)


def test_packed_blocks_cross_line_boundaries():
    ids = [np.array([10, 11, 12]), np.array([20]), np.array([30, 31])]
    stream = [BOS_ID, 10, 11, 12, EOS_ID, BOS_ID, 20, EOS_ID, BOS_ID, 30, 31, EOS_ID]
    assert pack_stream(ids).tolist() == stream
    batcher = PackedBatcher(ids, 4, 8, shuffle=False)
    assert batcher.num_blocks == 3 and batcher.blocks_per_batch == 2
    assert [b.tolist() for b in batcher.epoch_batches(0)] == [[0, 1], [2]]
    first, last = batcher.iterate(0)
    # block j: input stream[4j : 4j + 4], target stream[4j + 1 : 4j + 5]; a bos target
    # (the start of the next line, after an eos) is not scored.
    assert first.tgt_in.tolist() == [[BOS_ID, 10, 11, 12], [EOS_ID, BOS_ID, 20, EOS_ID]]
    assert first.tgt_out.tolist() == [[10, 11, 12, EOS_ID], [PAD_ID, 20, EOS_ID, PAD_ID]]
    assert last.tgt_in.tolist() == [[BOS_ID, 30, 31]]             # the short last block
    assert last.tgt_out.tolist() == [[30, 31, EOS_ID]]
    assert first.src.shape == (2, 0) and first.tgt_lengths.tolist() == [4, 2]
    # The scored targets are exactly the line layout's: every piece and every eos, once.
    assert batcher.target_tokens(np.arange(3)) == sum(len(x) + 1 for x in ids)


def test_packed_epochs_cover_the_stream_once_shuffled_by_seed_and_epoch():
    rng = np.random.default_rng(1)
    ids = [rng.integers(4, 100, rng.integers(1, 30)) for _ in range(200)]
    batcher = PackedBatcher(ids, 16, 100, seed=7)
    assert batcher.blocks_per_batch == 6
    stream = pack_stream(ids)
    batches = batcher.epoch_batches(3)
    assert all(len(b) <= 6 for b in batches)
    order = np.concatenate(batches)
    assert sorted(order.tolist()) == list(range(batcher.num_blocks))
    assert order.tolist() != sorted(order.tolist())
    # Reassembled in block order, the targets are the stream shifted by one.
    targets = {}
    for batch in batcher.iterate(3):
        for row, block in enumerate(batch.indices.tolist()):
            targets[block] = batch.tgt_out[row, :batcher.block_lengths[block]]
    joined = torch.cat([targets[b] for b in range(batcher.num_blocks)])
    expected = torch.from_numpy(stream[1:]).masked_fill(torch.from_numpy(stream[1:]) == BOS_ID,
                                                        PAD_ID)
    assert torch.equal(joined, expected)
    again = PackedBatcher(ids, 16, 100, seed=7)
    assert [b.tolist() for b in again.epoch_batches(3)] == [b.tolist() for b in batches]
    assert [b.tolist() for b in again.epoch_batches(4)] != [b.tolist() for b in batches]
    assert [b.tolist() for b in PackedBatcher(ids, 16, 100, seed=8).epoch_batches(3)] != \
        [b.tolist() for b in batches]
    resumed = [b.indices.tolist() for b in again.iterate(3, start=5)]
    assert resumed == [b.tolist() for b in batches[5:]]


def test_pack_settings_that_cannot_work():
    with pytest.raises(BatchingError, match="pack length 64 must be in"):
        PackedBatcher([np.arange(5)], 64, 32)
    with pytest.raises(BatchingError, match="at least one line"):
        PackedBatcher([], 8, 32)


@pytest.fixture
def text_corpus(tmp_path):
    lines = ["the cat sat on the mat", "a dog ran", "", "the end of the line"] * 20
    write(tmp_path / "train.txt", "\n".join(lines) + "\n")
    write(tmp_path / "dev.txt", "the cat ran\n")
    write_text_metadata(tmp_path, "en")
    return tmp_path


def test_vocab_and_stats_on_a_text_corpus(text_corpus, capsys):
    assert main(["vocab", "--data", str(text_corpus), "--size", "290"]) == 0
    out = capsys.readouterr().out
    assert "train.txt: 60 lines; skipped 20 empty" in out
    assert "round trip exact for 60 of 60" in out
    assert main(["data", "stats", "--data", str(text_corpus), "--max-tokens", "64",
                 "--max-len", "7"]) == 0
    out = capsys.readouterr().out
    assert "filtered" in out and "lines longer than 7 tokens" in out and "padding" in out
    split = load_text_split(text_corpus, "dev", Tokenizer(text_corpus / "spm.model"))
    assert len(split.ids) == 1 and split.line_numbers == [1]


def test_vocab_on_bad_text_names_file_and_line(tmp_path, capsys):
    write(tmp_path / "train.txt", b"fine\nadi\xf3s\n")
    assert main(["vocab", "--data", str(tmp_path), "--size", "50"]) == 1
    err = capsys.readouterr().err
    assert "train.txt:2: invalid UTF-8" in err and "Traceback" not in err


def test_load_text_split_filters_long_lines(tmp_path):
    write(tmp_path / "train.txt", "a b\n" + " ".join(["word"] * 40) + "\nc\n")
    tokenizer = train_tokenizer(["a b c word"] * 10, tmp_path, 272)
    split = load_text_split(tmp_path, "train", tokenizer, max_len=10)
    assert split.line_numbers == [1, 3]
    assert split.report[-1].startswith("filtered 1 of 3 lines longer than 10 tokens; "
                                       "the longest is line 2")
