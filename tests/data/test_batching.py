import numpy as np
import pytest
import torch

from transduce.data.batching import BatchingError, LengthFilter, TokenBatcher
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


def random_dataset(n=500, seed=0):
    """Sentence pairs whose lengths correlate as translations' do."""
    rng = np.random.default_rng(seed)
    src = [rng.integers(4, 100, rng.integers(1, 60)) for _ in range(n)]
    tgt = [rng.integers(4, 100, max(1, int(len(s) * rng.uniform(0.8, 1.25)))) for s in src]
    return src, tgt


@pytest.mark.parametrize("max_tokens", [100, 512, 3000])
def test_every_batch_fits_the_budget_and_every_pair_appears_once(max_tokens):
    src, tgt = random_dataset()
    batcher = TokenBatcher(src, tgt, max_tokens, seed=3)
    for epoch in range(2):
        seen = []
        for batch in batcher.iterate(epoch):
            assert batch.src.numel() <= max_tokens and batch.tgt_in.numel() <= max_tokens
            seen.extend(batch.indices.tolist())
        assert sorted(seen) == list(range(len(src)))


def test_batches_are_deterministic_per_seed_and_epoch():
    src, tgt = random_dataset()
    a = TokenBatcher(src, tgt, 512, seed=1).epoch_batches(0)
    b = TokenBatcher(src, tgt, 512, seed=1).epoch_batches(0)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    other_epoch = TokenBatcher(src, tgt, 512, seed=1).epoch_batches(1)
    other_seed = TokenBatcher(src, tgt, 512, seed=2).epoch_batches(0)
    assert [list(x) for x in other_epoch] != [list(x) for x in a]
    assert [list(x) for x in other_seed] != [list(x) for x in a]


def test_resume_mid_epoch_continues_with_the_same_batches():
    src, tgt = random_dataset()
    batcher = TokenBatcher(src, tgt, 512, seed=5)
    full = [b.indices.tolist() for b in batcher.iterate(epoch=2)]
    resumed = [b.indices.tolist() for b in TokenBatcher(src, tgt, 512, seed=5).iterate(2, start=7)]
    assert resumed == full[7:]


def test_collate_layout():
    src = [np.array([10, 11, 12]), np.array([20])]
    tgt = [np.array([30]), np.array([40, 41])]
    batch = TokenBatcher(src, tgt, 100, shuffle=False).collate(np.array([0, 1]))
    assert batch.src.tolist() == [[10, 11, 12, EOS_ID], [20, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 30, PAD_ID], [BOS_ID, 40, 41]]
    assert batch.tgt_out.tolist() == [[30, EOS_ID, PAD_ID], [40, 41, EOS_ID]]
    assert batch.src_lengths.tolist() == [4, 2] and batch.tgt_lengths.tolist() == [2, 3]
    assert batch.src.dtype == torch.long


def test_padding_is_small_when_lengths_are_grouped():
    src, tgt = random_dataset(2000)
    batcher = TokenBatcher(src, tgt, 2048, seed=0)
    unsorted_padding = []
    for start in range(0, 2000, 40):  # the same batch sizes without grouping
        s, t = src[start:start + 40], tgt[start:start + 40]
        padded = len(s) * (max(map(len, s)) + max(map(len, t)) + 2)
        unsorted_padding.append(1 - (sum(map(len, s)) + sum(map(len, t)) + 2 * len(s)) / padded)
    assert batcher.padding_fraction(0) < 0.1
    assert batcher.padding_fraction(0) < np.mean(unsorted_padding) / 3


def test_a_pair_longer_than_the_budget_is_an_error_at_start_up():
    src, tgt = random_dataset()
    src[7] = np.arange(4, 300)
    with pytest.raises(BatchingError, match=r"1 of 500 pairs cannot fit .* \(line 8\) has 297 tokens"):
        TokenBatcher(src, tgt, 200, line_numbers=list(range(1, 501)))


def test_length_filter_counts_and_reports_the_longest():
    src = [np.arange(5), np.arange(50), np.arange(3), np.arange(9)]
    tgt = [np.arange(4), np.arange(6), np.arange(70), np.arange(9)]
    kept = LengthFilter.apply(src, tgt, max_len=10)
    assert kept.kept.tolist() == [0, 3] and kept.dropped.tolist() == [1, 2]
    report = kept.report(src, tgt, [11, 12, 13, 14], max_len=10)
    assert report == ("filtered 2 of 4 pairs longer than 10 tokens; the longest is line 13 "
                      "with 4 source and 71 target tokens")


def test_a_length_filter_that_keeps_nothing_says_what_the_shortest_needs():
    src, tgt = [np.arange(5), np.arange(3)], [np.arange(4), np.arange(7)]
    with pytest.raises(BatchingError, match=r"^max_len=5: none of the 2 pairs fits; the "
                                            r"shortest needs 6 tokens on its longer side"):
        LengthFilter.apply(src, tgt, max_len=5)
    assert len(LengthFilter.apply([], [], max_len=5).kept) == 0      # an empty split is no error
