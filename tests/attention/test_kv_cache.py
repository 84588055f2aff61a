import pytest
import torch

from transduce.attention import (AttentionCache, KVCache, LinearAttention, SlidingWindowAttention,
                                 SoftmaxAttention)
from transduce.attention.kv_cache import keep_rows


def test_update_appends_in_place_and_returns_the_filled_part():
    cache = KVCache(2, 3, max_len=6, head_dim=4)
    buffer = cache.k
    k1, v1 = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    cache.update(k1, v1)
    k, v = cache.update(k2, v2)
    assert cache.length == 3 and cache.k is buffer
    torch.testing.assert_close(k, torch.cat([k1, k2], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([v1, v2], dim=2), rtol=0, atol=0)
    assert k.data_ptr() == buffer.data_ptr()  # a view, not a copy


def test_overflow_and_shape_mismatch_are_clear_errors():
    cache = KVCache(1, 2, max_len=2, head_dim=4)
    cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="KV cache full"):
        cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match="cannot append"):
        KVCache(1, 2, 4, 4).update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))


def test_reorder_same_batch_size_permutes_rows():
    cache = KVCache(3, 1, max_len=4, head_dim=2)
    k, v = torch.randn(3, 1, 2, 2), torch.randn(3, 1, 2, 2)
    cache.update(k, v)
    index = torch.tensor([2, 2, 0])
    cache.reorder(index)
    got_k, got_v = cache.k[:, :, :2], cache.v[:, :, :2]
    torch.testing.assert_close(got_k, k[index], rtol=0, atol=0)
    torch.testing.assert_close(got_v, v[index], rtol=0, atol=0)


def test_reorder_can_shrink_the_batch():
    cache = KVCache(4, 2, max_len=5, head_dim=3)
    k, v = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    cache.update(k, v)
    cache.reorder(torch.tensor([3, 1]))
    assert cache.batch_size == 2 and cache.length == 3 and cache.max_len == 5
    k_all, _ = cache.update(torch.zeros(2, 2, 1, 3), torch.zeros(2, 2, 1, 3))
    torch.testing.assert_close(k_all[:, :, :3], k[[3, 1]], rtol=0, atol=0)


@pytest.mark.parametrize("index,in_place", [
    ([0, 1, 2, 3, 4, 5], True),          # nothing moves: no copy at all
    ([0, 0, 2, 3, 4, 4], True),          # two beams continue another beam (copied in place)
    ([5, 4, 3, 2, 1, 0], False),         # most rows move (one gather into a new buffer)
    ([0, 5, 2], True),                   # the batch shrinks, the last row fills a hole
    ([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5], False),   # it grows (beams of each sentence)
])
def test_keep_rows_equals_index_select_over_the_filled_part(index, in_place):
    x = torch.randn(6, 2, 7, 3)
    expected = x.index_select(0, torch.tensor(index))[:, :, :4]
    unfilled = x[:, :, 4:].clone()
    got = keep_rows(x, torch.tensor(index), length=4)
    assert got.shape == (len(index), 2, 7, 3)
    torch.testing.assert_close(got[:, :, :4], expected, rtol=0, atol=0)
    assert (got.data_ptr() == x.data_ptr()) == in_place
    if in_place:  # positions past `length` are not touched
        torch.testing.assert_close(x[:, :, 4:], unfilled, rtol=0, atol=0)


def test_keep_rows_without_length_copies_whole_rows():
    x = torch.randn(4, 1, 1, 5) > 0                           # a (B, 1, 1, S) mask, say
    expected = x[[3, 1, 2]].clone()
    torch.testing.assert_close(keep_rows(x, torch.tensor([3, 1, 2])), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_nbytes_follows_the_formula(dtype, size):
    batch, kv_heads, tokens, head_dim = 3, 2, 17, 8
    cache = KVCache(batch, kv_heads, tokens, head_dim, dtype=dtype)
    assert cache.nbytes == 2 * kv_heads * head_dim * size * tokens * batch


KINDS = [SoftmaxAttention(), LinearAttention(), SlidingWindowAttention(window=3)]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_every_cache_measures_what_its_formula_says(kind, dtype, tokens):
    if dtype == torch.int8 and kind.name != "softmax":
        with pytest.raises(ValueError, match="int8"):
            kind.new_cache(2, 2, 8, tokens, dtype, "meta")
        return
    cache = kind.new_cache(2, 2, 8, tokens, dtype, "meta")
    assert isinstance(cache, AttentionCache)
    assert cache.nbytes == kind.cache_bytes(2, tokens, 2, 8, dtype)[0]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_cache_reorders_like_index_select(kind):
    """After a reorder, a step attends exactly as caches built from the chosen rows."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8)
    step = [torch.randn(3, 2, 1, 8) for _ in range(3)]
    index = torch.tensor([2, 2, 0])
    reordered = kind.new_cache(4, 2, 8, 8, torch.float32, "cpu")
    reordered.attend(q, k, v, None, causal=True, impl="sdpa")
    reordered.reorder(index)
    fresh = kind.new_cache(3, 2, 8, 8, torch.float32, "cpu")
    fresh.attend(q[index], k[index], v[index], None, causal=True, impl="sdpa")
    assert reordered.batch_size == 3 and reordered.length == fresh.length == 3
    torch.testing.assert_close(reordered.attend(*step, None, causal=True, impl="sdpa"),
                               fresh.attend(*step, None, causal=True, impl="sdpa"))
