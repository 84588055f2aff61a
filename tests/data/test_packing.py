"""Pairs packed into fixed rows (data/packing.py): every pair once an epoch, placed whole
in its layouts, with sentence numbers that keep it to itself; batches of one shape."""

import numpy as np
import pytest
import torch

from transduce.data.batching import BatchingError
from transduce.data.packing import PackedPairBatcher
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from tests.data.test_batching import random_dataset


def batcher(length=80, max_tokens=320, seed=0, **kwargs):
    src, tgt = random_dataset()
    return PackedPairBatcher(src, tgt, length, max_tokens, seed=seed, **kwargs), src, tgt


def test_every_pair_appears_once_an_epoch_and_every_batch_has_one_shape():
    packer, src, _ = batcher()
    batches = packer.epoch_batches(0)
    seen = np.concatenate(list(batches))
    assert sorted(seen.tolist()) == list(range(len(src)))
    for indices in batches:
        batch = packer.collate(indices)
        assert batch.src.shape == batch.tgt_in.shape == batch.tgt_out.shape == (4, 80)
        assert sorted(batch.indices.tolist()) == sorted(indices.tolist())
        assert batch.num_tgt_tokens == packer.target_tokens(indices) == \
            int((batch.tgt_out != PAD_ID).sum())


def test_batches_are_pure_in_seed_and_epoch():
    a, b = batcher(seed=3)[0], batcher(seed=3)[0]
    assert all(np.array_equal(x, y) for x, y in zip(a.epoch_batches(1), b.epoch_batches(1)))
    assert not np.array_equal(a.epoch_batches(0)[0], a.epoch_batches(1)[0])
    assert all(np.array_equal(x, y) for x, y in zip(a.epoch_batches(2)[5:], list(a.epoch_batches(2))[5:]))


def test_each_pair_sits_whole_in_its_row_with_its_own_number():
    packer, src, tgt = batcher()
    batch = packer.collate(packer.epoch_batches(0)[0])
    rows = packer.placement(packer.epoch_batches(0)[0])
    for r, pairs in enumerate(rows):
        s_at = t_at = 0
        for number, pair in enumerate(pairs):
            s, t = src[pair], tgt[pair]
            assert batch.src[r, s_at:s_at + len(s) + 1].tolist() == list(s) + [EOS_ID]
            assert batch.tgt_in[r, t_at:t_at + len(t) + 1].tolist() == [BOS_ID] + list(t)
            assert batch.tgt_out[r, t_at:t_at + len(t) + 1].tolist() == list(t) + [EOS_ID]
            assert (batch.src_numbers[r, s_at:s_at + len(s) + 1] == number).all()
            assert (batch.tgt_numbers[r, t_at:t_at + len(t) + 1] == number).all()
            s_at, t_at = s_at + len(s) + 1, t_at + len(t) + 1
        assert (batch.src[r, s_at:] == PAD_ID).all() and (batch.tgt_in[r, t_at:] == PAD_ID).all()
        assert (batch.src_numbers[r, s_at:] == -1).all()
        assert (batch.tgt_numbers[r, t_at:] == -1).all()
    order = [pair for pairs in rows for pair in pairs]
    assert batch.indices.tolist() == order
    assert batch.tgt_lengths.tolist() == [len(tgt[p]) + 1 for p in order]
    moved = batch.to("cpu")
    assert torch.equal(moved.src_numbers, batch.src_numbers) and moved.segments is not None


def test_a_batch_closes_only_when_the_next_pair_fits_no_row():
    packer, src, tgt = batcher(length=128, max_tokens=1024)
    batches = packer.epoch_batches(0)
    for indices, following in zip(batches, list(batches)[1:]):
        batch, opener = packer.collate(indices), following[0]
        room_src = (batch.src == PAD_ID).sum(1)
        room_tgt = (batch.tgt_in == PAD_ID).sum(1)
        assert not ((room_src > len(src[opener])) & (room_tgt > len(tgt[opener]))).any()
    real = sum(int((packer.collate(b).src != PAD_ID).sum() + (packer.collate(b).tgt_in != PAD_ID).sum())
               for b in batches)
    assert packer.padding_fraction(0) == pytest.approx(1 - real / (2 * len(batches) * 8 * 128))


def test_refusals_name_the_line_and_the_setting():
    src, tgt = random_dataset()
    longest = int(np.argmax([max(len(s), len(t)) for s, t in zip(src, tgt)]))
    with pytest.raises(BatchingError, match=f"the longest \\(line {longest + 10}\\)"):
        PackedPairBatcher(src, tgt, 8, 64, line_numbers=range(10, 10 + len(src)))
    with pytest.raises(BatchingError, match="pack length 300 must be in"):
        PackedPairBatcher(src, tgt, 300, 256)
    packer = batcher()[0]
    with pytest.raises(BatchingError, match="do not fit one packed batch"):
        packer.collate(np.arange(len(src)))
