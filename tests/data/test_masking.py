"""BERT's inputs: masking proportions and exclusions, next-sentence pairs, the encoder
batcher's layouts, determinism in (seed, epoch, batch)."""

import math

import numpy as np
import pytest
import torch

from transduce.data.batching import EncoderBatcher
from transduce.data.masking import (CLS_ID, IGNORE, MASK_ID, NUM_SPECIALS, SEP_ID,
                                    crop_pair, generator, mask_tokens, masked_count,
                                    next_sentence_pairs)
from transduce.data.tokenizer import PAD_ID, UNK_ID

VOCAB = 1000


def random_batch(rows=4000, width=40, seed=0):
    """(B, T) rows [CLS] pieces [SEP] padding, of random lengths."""
    rng = np.random.default_rng(seed)
    ids = np.full((rows, width), PAD_ID, dtype=np.int64)
    for row in range(rows):
        n = rng.integers(1, width - 1)
        ids[row, 0], ids[row, 1:n + 1], ids[row, n + 1] = CLS_ID, rng.integers(
            NUM_SPECIALS, VOCAB, n), SEP_ID
    return torch.from_numpy(ids)


def test_masking_proportions_and_exclusions():
    ids = random_batch()
    inputs, labels = mask_tokens(ids, VOCAB, generator(1, 0, 0))
    chosen = labels != IGNORE
    pieces = ids >= NUM_SPECIALS
    # Exactly round(15%) (at least one) of each row's pieces; never a special or padding.
    assert torch.equal(chosen.sum(1), masked_count(pieces.sum(1)))
    assert not (chosen & ~pieces).any()
    assert torch.equal(labels[chosen], ids[chosen])
    assert (labels[~chosen] == IGNORE).all()
    assert torch.equal(inputs[~chosen], ids[~chosen])
    share = chosen.sum().item() / pieces.sum().item()
    assert abs(share - 0.15) < 0.02       # rounding per row moves it a little
    n = chosen.sum().item()
    masked = (inputs[chosen] == MASK_ID).sum().item() / n
    unchanged = (inputs[chosen] == ids[chosen]).sum().item() / n
    replaced = 1 - masked - unchanged
    # 4 standard deviations of a binomial share over n draws (a random piece can equal
    # the original with probability 1/996, counted as unchanged).
    for observed, expected in ((masked, 0.8), (replaced, 0.1), (unchanged, 0.1)):
        assert abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / n) + 0.002
    assert (inputs[chosen] >= NUM_SPECIALS).sum() + (inputs[chosen] == MASK_ID).sum() == n


def test_masking_is_a_function_of_its_key():
    ids = random_batch(rows=50)
    a = mask_tokens(ids, VOCAB, generator(1, 2, 3))
    b = mask_tokens(ids, VOCAB, generator(1, 2, 3))
    c = mask_tokens(ids, VOCAB, generator(1, 2, 4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_mask_is_unk_which_byte_fallback_never_produces(tmp_path):
    from transduce.data.tokenizer import train_tokenizer
    tokenizer = train_tokenizer(["the quick brown fox", "jumps over the lazy dog"] * 20,
                                tmp_path, vocab_size=300)
    ids = tokenizer.encode(["Ünïcödé ✓ 漢字 never seen \x7f"])[0]
    assert MASK_ID == UNK_ID and UNK_ID not in ids and min(ids) >= NUM_SPECIALS


def test_next_sentence_pairs_are_half_consecutive_half_random():
    partners, labels = next_sentence_pairs(20001, np.random.default_rng(0))
    first = np.arange(20000)
    assert abs(labels.mean() - 0.5) < 4 * math.sqrt(0.25 / 20000)
    assert (partners[labels == 0] == first[labels == 0] + 1).all()
    negative = labels == 1
    assert not (partners[negative] == first[negative] + 1).any()
    assert not (partners[negative] == first[negative]).any()
    assert partners.min() >= 0 and partners.max() == 20000


def test_crop_pair_shortens_the_longer_side_first():
    a, b = crop_pair(np.arange(10), np.arange(4), max_len=12)
    assert (len(a), len(b)) == (5, 4)
    a, b = crop_pair(np.arange(10), np.arange(10), max_len=9)
    assert (len(a), len(b)) == (3, 3)
    a, none = crop_pair(np.arange(10), None, max_len=6)
    assert len(a) == 4 and none is None


def lines(count=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(NUM_SPECIALS, 50, rng.integers(2, 20)) for _ in range(count)]


def test_pair_batches_lay_out_cls_a_sep_b_sep_with_segments():
    ids = lines()
    batcher = EncoderBatcher(ids, max_tokens=200, max_len=24, vocab_size=50, pairs=True, seed=3)
    seen = 0
    for position, indices in enumerate(batcher.epoch_batches(0)):
        batch = batcher.collate(indices, (0, position))
        assert batch.ids.shape[0] * batch.ids.shape[1] <= 200
        assert batcher.target_tokens(indices) == int((batch.mlm_labels != IGNORE).sum())
        original = torch.where(batch.mlm_labels != IGNORE, batch.mlm_labels, batch.ids)
        for row, index in enumerate(indices.tolist()):
            a, b = crop_pair(ids[index], ids[batcher._partners[index]], 24)
            expected = [CLS_ID, *a, SEP_ID, *b, SEP_ID]
            assert original[row, :len(expected)].tolist() == expected
            assert (original[row, len(expected):] == PAD_ID).all()
            segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
            assert batch.segments[row, :len(expected)].tolist() == segments
            follows = batcher._partners[index] == index + 1
            assert batch.nsp_labels[row].item() == (0 if follows else 1)
            seen += 1
    assert seen == len(ids) - 1
    # Pairs are drawn anew each epoch, the same for the same epoch.
    batcher.epoch_batches(0)
    first = batcher._partners.copy()
    batcher.epoch_batches(1)
    assert not np.array_equal(first, batcher._partners)
    batcher.epoch_batches(0)
    assert np.array_equal(first, batcher._partners)


def test_sentence_batches_mask_deterministically_by_key():
    batcher = EncoderBatcher(lines(), max_tokens=200, max_len=16, vocab_size=50, seed=1)
    indices = batcher.epoch_batches(0)[0]
    a, b = batcher.collate(indices, (0, 0)), batcher.collate(indices, (0, 0))
    c = batcher.collate(indices, (1, 0))
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.mlm_labels, c.mlm_labels)
    assert (a.ids[:, 0] == CLS_ID).all() and a.nsp_labels is None and a.ids.shape[1] <= 16


def test_classification_batches_carry_labels_unmasked():
    ids = lines(10)
    batcher = EncoderBatcher(ids, max_tokens=100, max_len=30, vocab_size=50,
                             labels=list(range(10)), mask=False, shuffle=False)
    for indices in batcher.epoch_batches(0):
        batch = batcher.collate(indices)
        assert batch.mlm_labels is None and batch.labels.tolist() == indices.tolist()
        for row, index in enumerate(indices.tolist()):
            assert batch.ids[row, :len(ids[index]) + 2].tolist() == \
                [CLS_ID, *ids[index].tolist(), SEP_ID]
        assert batcher.target_tokens(indices) == len(indices)


def test_a_sequence_longer_than_the_batch_is_refused():
    with pytest.raises(Exception, match="max_len=64 tokens cannot fit a batch of 32"):
        EncoderBatcher(lines(), max_tokens=32, max_len=64, vocab_size=50)
