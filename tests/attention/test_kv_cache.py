import pytest
import torch

from transduce.attention import (AttentionCache, KVCache, LinearAttention, SlidingWindowAttention,
                                 SoftmaxAttention)
from transduce.attention.kinds import SparseAttention
from transduce.attention.kv_cache import (Int4KVCache, dequantize_int4, dequantize_int8,
                                          keep_rows, plan_rows, quantize_int4,
                                          quantize_int8)
from transduce.attention.sparse import Pattern


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
@pytest.mark.parametrize("planned", [False, True])
def test_keep_rows_equals_index_select_over_the_filled_part(index, in_place, planned):
    x = torch.randn(6, 2, 7, 3)
    expected = x.index_select(0, torch.tensor(index))[:, :, :4]
    unfilled = x[:, :, 4:].clone()
    rows = plan_rows(torch.tensor(index), 6) if planned else torch.tensor(index)
    got = keep_rows(x, rows, length=4)
    assert got.shape == (len(index), 2, 7, 3)
    torch.testing.assert_close(got[:, :, :4], expected, rtol=0, atol=0)
    assert (got.data_ptr() == x.data_ptr()) == in_place
    if in_place:  # positions past `length` are not touched
        torch.testing.assert_close(x[:, :, 4:], unfilled, rtol=0, atol=0)


def test_a_plan_for_another_row_count_is_made_again():
    x = torch.randn(3, 1, 2, 2)
    plan = plan_rows(torch.tensor([0, 1, 2, 1]), 6)           # made for 6 rows: in place
    assert plan.moved is not None and plan.count == 1
    got = keep_rows(x, plan)                                  # 3 rows cannot hold 4
    torch.testing.assert_close(got, x[[0, 1, 2, 1]], rtol=0, atol=0)


def test_a_reorder_plans_once_for_every_layer(monkeypatch):
    from transduce.attention import kv_cache
    from transduce.model import transformer

    planned = []
    monkeypatch.setattr(transformer, "plan_rows",
                        lambda *args: planned.append(args) or kv_cache.plan_rows(*args))
    caches = [KVCache(4, 2, 6, 3) for _ in range(3)]
    for cache in caches:
        cache.update(torch.randn(4, 2, 5, 3), torch.randn(4, 2, 5, 3))
    expected = [cache.k[[0, 0, 2, 3], :, :5].clone() for cache in caches]
    state = transformer.DecoderState([], torch.ones(1, 1, 1, 2, dtype=torch.bool), caches)
    state.reorder(torch.tensor([0, 0, 2, 3]))
    assert len(planned) == 1
    for cache, want in zip(caches, expected):
        torch.testing.assert_close(cache.k[:, :, :5], want, rtol=0, atol=0)


def test_keep_rows_without_length_copies_whole_rows():
    x = torch.randn(4, 1, 1, 5) > 0                           # a (B, 1, 1, S) mask, say
    expected = x[[3, 1, 2]].clone()
    torch.testing.assert_close(keep_rows(x, torch.tensor([3, 1, 2])), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_nbytes_follows_the_formula(dtype, size):
    batch, kv_heads, tokens, head_dim = 3, 2, 17, 8
    cache = KVCache(batch, kv_heads, tokens, head_dim, dtype=dtype)
    assert cache.nbytes == 2 * kv_heads * head_dim * size * tokens * batch


KINDS = [SoftmaxAttention(), LinearAttention(), SlidingWindowAttention(window=3),
         SparseAttention(Pattern(window=1, global_tokens=1))]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int4])
@pytest.mark.parametrize("tokens,head_dim", [(1, 8), (2, 8), (7, 8), (3, 64)])
def test_every_cache_measures_what_its_formula_says(kind, dtype, tokens, head_dim):
    if dtype in (torch.int8, torch.int4) and kind.name not in ("softmax", "sliding"):
        with pytest.raises(ValueError, match=str(dtype).removeprefix("torch.")):
            kind.new_cache(2, 2, head_dim, tokens, dtype, "meta")
        return
    cache = kind.new_cache(2, 2, head_dim, tokens, dtype, "meta")
    assert isinstance(cache, AttentionCache)
    assert cache.nbytes == kind.cache_bytes(2, tokens, 2, head_dim, dtype)[0]


def test_int4_sizes_are_a_quarter_of_float16_plus_the_group_scales():
    cache = SoftmaxAttention().new_cache(1, 1, 64, 10, torch.int4, "meta")
    # per token and head: 64 values x 1/2 byte + 2 groups x 4 bytes, for K and V
    assert cache.nbytes == 2 * (32 + 8) * 10


@pytest.mark.parametrize("head_dim", [8, 64, 96])
def test_int4_round_trip_is_within_half_a_step_of_each_group(head_dim):
    x = torch.randn(3, 2, 5, head_dim) * torch.linspace(0.1, 10, head_dim)
    group = 32 if head_dim % 32 == 0 else head_dim
    packed, scale = quantize_int4(x, group)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == head_dim // 2
    restored = dequantize_int4(packed, scale, torch.float32)
    step = scale.repeat_interleave(group, dim=-1)
    assert ((restored - x).abs() <= step / 2 + 1e-6).all()
    assert (x.abs().unflatten(-1, (-1, group)).amax(-1) - 7 * scale).abs().max() < 1e-5


def test_int4_cache_attends_exactly_over_its_round_tripped_keys_and_refuses_odd_heads():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 6, 64), torch.randn(2, 2, 6, 64), torch.randn(2, 2, 6, 64)
    k4, v4 = (dequantize_int4(*quantize_int4(x, 32), torch.float32) for x in (k, v))
    exact = KVCache(2, 2, 8, 64).attend(q, k4, v4, None, causal=True, impl="sdpa")
    int4 = Int4KVCache(2, 2, 8, 64)
    first = int4.attend(q[:, :, :4], k[:, :, :4], v[:, :, :4], None, causal=True, impl="sdpa")
    last = int4.attend(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], None, causal=True, impl="sdpa")
    torch.testing.assert_close(torch.cat([first, last], dim=2), exact, rtol=0, atol=1e-6)
    full = KVCache(2, 2, 8, 64).attend(q, k, v, None, causal=True, impl="sdpa")
    assert (exact - full).abs().mean() < 0.1     # 4 bits: close, not equal
    with pytest.raises(ValueError, match="even"):
        Int4KVCache(1, 1, 4, 7)


def test_a_quantized_window_attends_exactly_over_its_round_tripped_keys():
    """int8 and int4 windows: what the float window computes on the keys and values
    each quantizes and restores, over steps that slide it and one that forgets a token;
    a full-size int4 window is a quarter of float16's bytes plus the scales."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    kind = SlidingWindowAttention(window=3)
    for dtype, round_trip in ((torch.int8, lambda x: dequantize_int8(*quantize_int8(x),
                                                                     torch.float32)),
                              (torch.int4, lambda x: dequantize_int4(*quantize_int4(x, 32),
                                                                     torch.float32))):
        quantized, exact = (kind.new_cache(2, 2, 64, 9, d, "cpu")
                            for d in (dtype, torch.float32))
        kq, vq = round_trip(k), round_trip(v)
        for cache in (quantized, exact):
            cache.allow_rewind(1)
        for start, end in ((0, 4), (4, 5), (5, 7)):
            got = quantized.attend(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                   None, causal=True, impl="sdpa")
            expected = exact.attend(q[:, :, start:end], kq[:, :, start:end],
                                    vq[:, :, start:end], None, causal=True, impl="sdpa")
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        quantized.rewind(6)
        exact.rewind(6)
        torch.testing.assert_close(
            quantized.attend(q[:, :, 7:9], k[:, :, 7:9], v[:, :, 7:9], None, causal=True,
                             impl="sdpa"),
            exact.attend(q[:, :, 7:9], kq[:, :, 7:9], vq[:, :, 7:9], None, causal=True,
                         impl="sdpa"), rtol=0, atol=1e-6)
        assert quantized.held == exact.held == 4
    full = kind.new_cache(1, 1, 64, 100, torch.int4, "meta")
    assert full.nbytes == 2 * (32 + 8) * 3


@pytest.mark.parametrize("kind,dtype", [(kind, torch.float32) for kind in KINDS]
                         + [(SoftmaxAttention(), torch.int4),
                            (SlidingWindowAttention(window=3), torch.int8),
                            (SlidingWindowAttention(window=3), torch.int4)],
                         ids=lambda x: str(x)[:20])
def test_every_cache_reorders_like_index_select(kind, dtype):
    """After a reorder, a step attends exactly as caches built from the chosen rows."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8)
    step = [torch.randn(3, 2, 1, 8) for _ in range(3)]
    index = torch.tensor([2, 2, 0])
    reordered = kind.new_cache(4, 2, 8, 8, dtype, "cpu")
    reordered.attend(q, k, v, None, causal=True, impl="sdpa")
    reordered.reorder(index)
    fresh = kind.new_cache(3, 2, 8, 8, dtype, "cpu")
    fresh.attend(q[index], k[index], v[index], None, causal=True, impl="sdpa")
    assert reordered.batch_size == 3 and reordered.length == fresh.length == 3
    torch.testing.assert_close(reordered.attend(*step, None, causal=True, impl="sdpa"),
                               fresh.attend(*step, None, causal=True, impl="sdpa"))


def test_decoding_outside_inference_mode_reorders_as_inside_it():
    """Caches that record a graph (prefill and steps run with gradients enabled) are
    reordered by a plain gather: the out= gather refuses them."""
    from transduce import Transformer, preset

    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=50, tgt_vocab_size=50)).eval()
    src, tokens = torch.randint(4, 50, (2, 5)), torch.randint(4, 50, (4, 1))
    found = []
    for mode in (torch.enable_grad, torch.inference_mode):
        with mode():
            state = model.prefill(src, max_len=8)
            state.reorder(torch.tensor([0, 0, 1, 1]))
            model.decode_step(tokens, state)
            state.reorder(torch.tensor([1, 0, 3, 3]))
            found.append(model.decode_step(tokens, state).detach().clone())
    torch.testing.assert_close(found[0], found[1], rtol=0, atol=0)
