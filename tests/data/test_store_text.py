"""A text corpus's token store for language models and encoders: packed blocks (GPT),
lines, masked-LM items with and without next-sentence pairs (BERT) give the same
batches from the store as from memory, batching reads no ids, collating reads only
the lines a batch covers, and a model trained a few steps either way is the same."""

import random
import shutil

import numpy as np
import pytest
import torch

from tests.data.test_store import RecordingTokens
from transduce.config import TrainConfig, preset
from transduce.data.batching import EncoderBatcher, PackedBatcher, TokenBatcher, pack_stream
from transduce.data.corpus import CorpusError, write_text_metadata
from transduce.data.dataset import load_text_split
from transduce.data.store import StoredIds, build_store, open_store
from transduce.data.tokenizer import BOS_ID, MODEL_NAME, PAD_ID, Tokenizer, train_tokenizer
from transduce.model import load_model
from transduce.train.loop import train

WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
VOCAB = 320


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """Counting lines from a random word on, some empty, some long; a vocabulary; and
    the training split's token store."""
    directory = tmp_path_factory.mktemp("counting")
    rng = random.Random(0)
    for split, size in (("train", 300), ("dev", 20)):
        lines = [" ".join(WORDS[rng.randint(0, 9):] * rng.choice((1, 1, 1, 6)))
                 if rng.random() > 0.05 else "" for _ in range(size)]
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_text_metadata(directory, "en")
    train_tokenizer([" ".join(WORDS)] * 10, directory, vocab_size=VOCAB)
    tokenizer = Tokenizer(directory / MODEL_NAME)
    build_store(directory, "train", tokenizer.path, tokenizer.vocab_size,
                tokenizer.fingerprint, workers=1, progress=False)
    return directory


def both_splits(directory, max_len=None):
    """The training split from the store and from memory (the store moved aside)."""
    tokenizer = Tokenizer(directory / MODEL_NAME)
    stored = load_text_split(directory, "train", tokenizer, max_len)
    shutil.move(directory / "tokens", directory / "aside")
    try:
        memory = load_text_split(directory, "train", tokenizer, max_len)
    finally:
        shutil.move(directory / "aside", directory / "tokens")
    assert isinstance(stored.ids, StoredIds) and not isinstance(memory.ids, StoredIds)
    assert list(np.asarray(stored.line_numbers)) == list(memory.line_numbers)
    return stored, memory


def assert_same_tensors(x, y, fields):
    for field in fields:
        a, b = getattr(x, field), getattr(y, field)
        assert (a is None and b is None) or (a.dtype == b.dtype and a.equal(b)), field


BATCH_FIELDS = ("src", "tgt_in", "tgt_out", "src_lengths", "tgt_lengths", "indices")
ENCODER_FIELDS = ("ids", "segments", "mlm_labels", "nsp_labels", "labels", "indices")


@pytest.mark.parametrize("length", [1, 7, 32])
def test_packed_blocks_from_the_store_equal_those_from_memory(counting, length):
    stored, memory = both_splits(counting)
    a = PackedBatcher(stored.ids, length, 4 * length, seed=2)
    b = PackedBatcher(memory.ids, length, 4 * length, seed=2)
    assert a.num_blocks == b.num_blocks and np.array_equal(a.tgt_lengths, b.tgt_lengths)
    for epoch in (0, 1):
        for x, y in zip(a.epoch_batches(epoch), b.epoch_batches(epoch), strict=True):
            assert np.array_equal(x, y)
            assert_same_tensors(a.collate(x), b.collate(y), BATCH_FIELDS)
    # against the whole stream built in memory (what PackedBatcher once kept)
    stream = pack_stream(memory.ids)
    for block in range(a.num_blocks):
        start, count = block * length, int(a.block_lengths[block])
        assert np.array_equal(a.stream(start, start + count + 1),
                              stream[start:start + count + 1])
        targets = stream[start + 1:start + count + 1]
        assert a.tgt_lengths[block] == np.count_nonzero(targets != BOS_ID)


@pytest.mark.parametrize("objective", [dict(pairs=False), dict(pairs=True)],
                         ids=["mlm", "mlm+nsp"])
def test_encoder_items_from_the_store_equal_those_from_memory(counting, objective):
    stored, memory = both_splits(counting)
    a = EncoderBatcher(stored.ids, 256, 24, VOCAB, seed=4, **objective)
    b = EncoderBatcher(memory.ids, 256, 24, VOCAB, seed=4, **objective)
    for epoch in (0, 1):
        for position, (x, y) in enumerate(zip(a.epoch_batches(epoch), b.epoch_batches(epoch),
                                              strict=True)):
            assert np.array_equal(x, y) and a.scored_counts(x) == b.scored_counts(y)
            assert_same_tensors(a.collate(x, (epoch, position)),
                                b.collate(y, (epoch, position)), ENCODER_FIELDS)


def test_lines_from_the_store_equal_those_from_memory(counting):
    stored, memory = both_splits(counting, max_len=20)
    assert "lines longer than 20 tokens" in stored.report[1]
    assert stored.report[1:] == memory.report[1:]
    a = TokenBatcher(None, stored.ids, 100, seed=1, line_numbers=stored.line_numbers)
    b = TokenBatcher(None, memory.ids, 100, seed=1, line_numbers=memory.line_numbers)
    for x, y in zip(a.epoch_batches(0), b.epoch_batches(0), strict=True):
        assert_same_tensors(a.collate(x), b.collate(y), BATCH_FIELDS)


def recording_ids(directory):
    opened = open_store(directory, "train", Tokenizer(directory / MODEL_NAME).fingerprint)
    ids = opened.sides["tgt"]
    return StoredIds(RecordingTokens(ids.tokens), ids.offsets)


def test_packing_and_encoder_batching_read_no_ids_and_collating_only_its_lines(counting):
    ids = recording_ids(counting)
    packed = PackedBatcher(ids, 16, 64, seed=1)
    batches = packed.epoch_batches(0)
    packed.padding_fraction(0)
    for pairs in (False, True):
        encoder = EncoderBatcher(ids, 256, 24, VOCAB, seed=1, pairs=pairs)
        encoder.epoch_batches(0)
        encoder.padding_fraction(0)
    assert not ids.tokens.read
    packed.collate(batches[0])
    starts = packed.line_starts
    covered = set()
    for block in batches[0]:
        first = int(block) * 16
        last = first + int(packed.block_lengths[block])         # the last target
        covered |= set(range(np.searchsorted(starts, first, side="right") - 1,
                             np.searchsorted(starts, last, side="right")))
    offsets = ids.offsets
    assert sorted(set(ids.tokens.read)) == \
        sorted({(int(offsets[k]), int(offsets[k + 1])) for k in covered})


def test_a_changed_text_file_is_refused(counting, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(counting, directory)
    with open(directory / "train.txt", "a", encoding="utf-8") as handle:
        handle.write("one two\n")
    with pytest.raises(CorpusError, match=r"train\.txt as it was before it changed.*"
                                          r"transduce data tokenize --data"):
        load_text_split(directory, "train", Tokenizer(directory / MODEL_NAME))


def trained_alike(counting, tmp_path, model_config, **config):
    """Trains from the store, then from the text (store moved aside): the same weights."""
    settings = dict(max_tokens=128, warmup_steps=3, max_steps=3, eval_every=1000,
                    save_every=1000, threads=1, dtype="float32")
    train(counting, tmp_path / "from-store", model_config, TrainConfig(**settings, **config))
    shutil.move(counting / "tokens", tmp_path / "aside")
    try:
        train(counting, tmp_path / "from-text", model_config, TrainConfig(**settings, **config))
    finally:
        shutil.move(tmp_path / "aside", counting / "tokens")
    a = load_model(tmp_path / "from-store").state_dict()
    b = load_model(tmp_path / "from-text").state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_packed_language_model_trains_the_same_from_the_store(counting, tmp_path, capsys):
    model = preset("gpt-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.1)
    trained_alike(counting, tmp_path, model, pack_length=32)
    assert "(token store, uint16)" in capsys.readouterr().out


def test_a_masked_lm_with_next_sentences_trains_the_same_from_the_store(counting, tmp_path):
    model = preset("bert-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.1)
    trained_alike(counting, tmp_path, model, objective="mlm,nsp")


def test_collated_padding_and_scoring_of_the_packed_layout(counting):
    stored, _ = both_splits(counting)
    batcher = PackedBatcher(stored.ids, 8, 16, shuffle=False)
    batch = batcher.collate(np.arange(batcher.num_blocks))
    assert (batch.tgt_out != PAD_ID).sum(dim=1).tolist() == batcher.tgt_lengths.tolist()
