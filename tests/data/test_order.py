"""The batchers' narrow index (data/order.py): the same batches as the plain lexsort and
item-by-item greedy cut, in int16 lengths and int32 orders, with nothing per pair in
Python objects, at a size where bytes per pair can be counted."""

import gc
import tracemalloc

import numpy as np
import pytest
import torch

from transduce.data import order as order_module
from transduce.data.batching import EncoderBatcher, PackedBatcher, TokenBatcher
from transduce.data.dataset import _stored_split
from transduce.data.order import EpochBatches, greedy_bounds, length_batches, narrow_lengths
from transduce.data.store import StoredIds, TakenLines, TokenStore, _offset_diffs


def reference_batches(lengths, max_tokens, rng, then=None):
    """The earlier implementation: lexsort with a tie permutation, cut item by item."""
    ties = rng.permutation(len(lengths)) if rng is not None else np.arange(len(lengths))
    keys = (ties, lengths) if then is None else (ties, then, lengths)
    order = np.lexsort(keys)
    batches, start, longest = [], 0, 0
    for position, index in enumerate(order):
        longest = max(longest, int(lengths[index]))
        if (position - start + 1) * longest > max_tokens:
            batches.append(order[start:position])
            start, longest = position, int(lengths[index])
    batches.append(order[start:])
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", [None, 0, 7])
@pytest.mark.parametrize("max_tokens", [60, 512, 5000])
def test_length_batches_equal_the_lexsort_and_item_by_item_cut(seed, max_tokens, monkeypatch):
    monkeypatch.setattr(order_module, "CHUNK", 97)         # several chunks, a ragged last
    data = np.random.default_rng(1)
    lengths = narrow_lengths(data.integers(1, 60, 1000))
    then = narrow_lengths(np.minimum(lengths, data.integers(1, 60, 1000)))
    for second in (None, then):
        rng = lambda: None if seed is None else np.random.default_rng(seed)  # noqa: E731
        ours = length_batches(lengths, max_tokens, rng(), then=second)
        assert same(ours, reference_batches(lengths, max_tokens, rng(), second))
        assert ours.order.dtype == np.int32


def test_lengths_too_wide_to_pack_fall_back_to_lexsort(monkeypatch):
    monkeypatch.setattr(order_module, "_key_bits", lambda count, groups: None)
    lengths = narrow_lengths(np.random.default_rng(2).integers(1, 40, 300))
    ours = length_batches(lengths, 200, np.random.default_rng(3), then=lengths // 2)
    reference = reference_batches(lengths, 200, np.random.default_rng(3), lengths // 2)
    assert same(ours, reference) and ours.order.dtype == np.int32


def test_greedy_bounds_cut_at_the_budget():
    # 3 x 2 = 6 fits, 4 x 3 does not; 2 x 5 > 6, so each 5 alone, as is the 3 before
    assert greedy_bounds(np.array([1, 2, 2, 3, 5, 5], dtype=np.int16), 6).tolist() == \
        [0, 3, 4, 5, 6]
    assert greedy_bounds(np.array([2, 2, 2, 3], dtype=np.int16), 9).tolist() == [0, 3, 4]


def test_epoch_batches_are_views_of_one_order_array():
    batches = length_batches(np.array([3, 1, 2, 2, 5], dtype=np.int16), 6,
                             np.random.default_rng(0))
    assert isinstance(batches, EpochBatches) and isinstance(batches[1:], EpochBatches)
    assert [b.tolist() for b in batches[1:]] == [b.tolist() for b in list(batches)[1:]]
    assert all(np.shares_memory(b, batches.order) for b in batches)
    assert sorted(np.concatenate(list(batches)).tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        batches[len(batches)]


def test_lengths_are_int16_or_int32_and_collated_tensors_int64():
    src = [np.arange(4, 9), np.arange(4, 6)]
    batcher = TokenBatcher(src, [np.arange(4, 7), np.arange(4, 5)], 100)
    assert batcher.src_lengths.dtype == batcher.tgt_lengths.dtype == np.int16
    batch = batcher.collate(batcher.epoch_batches(0)[0])
    assert batch.src_lengths.dtype == batch.tgt_lengths.dtype == batch.indices.dtype == \
        torch.long
    long_line = [np.full(40000, 5)]
    wide = TokenBatcher(None, long_line, 50000)
    assert wide.tgt_lengths.dtype == np.int32 and wide.target_tokens(np.array([0])) == 40001
    assert narrow_lengths(np.array([2**31], dtype=np.int64)).dtype == np.int64


def test_packed_and_encoder_batches_are_epoch_batches_too():
    lines = [np.arange(4, 4 + n) for n in (3, 5, 2, 7, 4)]
    packer = PackedBatcher(lines, 4, 8, seed=1)
    packed = packer.epoch_batches(0)
    assert isinstance(packed, EpochBatches) and all(len(b) <= 2 for b in packed)
    assert sorted(np.concatenate(list(packed)).tolist()) == list(range(packer.num_blocks))
    encoder = EncoderBatcher(lines, 40, 16, 300, seed=1).epoch_batches(0)
    assert isinstance(encoder, EpochBatches)
    assert sorted(np.concatenate(list(encoder)).tolist()) == list(range(5))


def fake_store(directory, pairs: int, seed: int = 0) -> TokenStore:
    """A store of `pairs` pairs whose ids are a sparse file of zeros (never read)."""
    rng = np.random.default_rng(seed)
    sides = {}
    for side in ("src", "tgt"):
        lengths = np.clip(rng.gamma(4.0, 9.0, pairs), 1, 400).astype(np.int64)
        lengths[::500] = 300                    # over the length filter's 256
        offsets = np.zeros(pairs + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        offsets.tofile(directory / f"{side}.offsets")
        with open(directory / f"{side}.bin", "wb") as handle:
            handle.truncate(2 * int(offsets[-1]))
        sides[side] = StoredIds(np.memmap(directory / f"{side}.bin", np.uint16, mode="r"),
                                np.memmap(directory / f"{side}.offsets", np.int64, mode="r"))
    np.arange(1, pairs + 1, dtype=np.uint32).tofile(directory / "lines")
    lines = np.memmap(directory / "lines", np.uint32, mode="r")
    return TokenStore(directory, sides, lines, {"dtype": "uint16", "skipped_empty": 0})


def test_a_million_pair_store_is_batched_in_a_few_bytes_a_pair(tmp_path):
    pairs = 1_000_000
    store = fake_store(tmp_path, pairs)
    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    split = _stored_split(store, 256)
    batcher = TokenBatcher(split.src_ids, split.tgt_ids, 4096, seed=1,
                           line_numbers=split.line_numbers)
    batches = batcher.epoch_batches(0)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert 0 < pairs - len(split.src_ids) < pairs // 100        # some filtered out
    assert isinstance(split.line_numbers, TakenLines)
    assert split.src_ids.rows is split.tgt_ids.rows is split.line_numbers.rows
    assert split.src_ids.rows.dtype == batches.order.dtype == np.int32
    assert batcher.src_lengths.dtype == batcher.tgt_lengths.dtype == np.int16
    # held: rows 4 + lengths 2 x 2 + order 4 bytes a pair, and per-batch arrays
    kept_bytes = sum(a.nbytes for a in (split.src_ids.rows, batcher.src_lengths,
                                        batcher.tgt_lengths, batches.order))
    assert kept_bytes <= 12 * pairs and held < 13 * pairs, held / pairs
    assert peak < 30 * pairs, peak / pairs
    gc.collect()
    assert len(gc.get_objects()) - objects < 1000               # nothing per pair
    kept = split.src_ids.rows
    assert split.line_numbers[5] == kept[5] + 1
    assert np.array_equal(np.asarray(split.line_numbers), kept + 1)


def test_lengths_are_read_from_the_offsets_file_or_any_array(tmp_path):
    store = fake_store(tmp_path, 1000)
    offsets = store.sides["src"].offsets
    expected = np.diff(np.asarray(offsets))
    assert np.array_equal(_offset_diffs(offsets), expected)
    assert _offset_diffs(offsets).dtype == np.int32
    assert np.array_equal(_offset_diffs(np.asarray(offsets)), expected)
    assert np.array_equal(_offset_diffs(offsets[10:]), expected[10:])    # a part of the map
