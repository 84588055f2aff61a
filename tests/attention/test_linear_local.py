"""Linear and sliding-window attention against float64 references written from the
formulas, with padding, causality, grouped heads and length 1."""

import pytest
import torch
import torch.nn.functional as F

from transduce.attention import masks
from transduce.attention.kv_cache import QuantizedKVCache, quantize_int8
from transduce.attention.linear import linear_attention, linear_attention_weights
from transduce.attention.local import SlidingKVCache, sliding_window_attention
from tests.attention.reference import reference_attention


def inputs(batch, heads, kv_heads, length, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float64)
    return q, k, v


def key_mask(batch, length):
    """Row 1 is padded from the middle; with batch 3, row 2 is entirely padding."""
    mask = torch.ones(batch, length, dtype=torch.bool)
    if batch > 1:
        mask[1, length // 2 + 1:] = False
    if batch > 2:
        mask[2] = False
    return mask


def linear_reference(q, k, v, mask, causal):
    """out_i = sum_j w_ij v_j with w_ij = phi(q_i).phi(k_j) / sum over allowed j, looped."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            keys = [j for j in range(k.shape[2]) if mask[b, j] and (not causal or j <= i)]
            if keys:
                w = (phi_q[b, :, i, None, :] * phi_k[b, :, keys]).sum(-1)        # (H, |keys|)
                out[b, :, i] = (w[..., None] * v[b, :, keys]).sum(1) / w.sum(-1, keepdim=True)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("length,chunk", [(1, 64), (19, 64), (19, 4)])
def test_linear_attention_equals_the_formula(causal, heads, kv_heads, length, chunk):
    q, k, v = inputs(3, heads, kv_heads, length, 8)
    mask = key_mask(3, length)
    expected = linear_reference(q, k, v, mask, causal)
    out, _ = linear_attention(q, k, v, mask, causal=causal, chunk=chunk)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    weights = linear_attention_weights(q, k, mask, causal=causal)
    torch.testing.assert_close(weights @ v.repeat_interleave(heads // kv_heads, 1), expected)
    assert not out[2].any()  # a fully padded row gives zeros, not NaN


def test_causal_linear_attention_continues_from_its_state():
    q, k, v = inputs(2, 4, 2, 12, 8)
    whole, (kv_sum, k_sum) = linear_attention(q, k, v, causal=True, chunk=5)
    first, state = linear_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], causal=True)
    rest, final = linear_attention(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], causal=True, state=state)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), whole)
    torch.testing.assert_close(final[0], kv_sum)
    torch.testing.assert_close(final[1], k_sum)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("impl", ["naive", "sdpa", "flash"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
def test_sliding_window_equals_a_banded_reference(causal, window, impl, heads, kv_heads):
    length = 29
    q, k, v = inputs(3, heads, kv_heads, length, 8)
    mask = key_mask(3, length)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    band = (i - j).abs() <= window
    if causal:
        band &= j <= i
    expected, _ = reference_attention(q, k, v, mask[:, None, None, :] & band)
    out = sliding_window_attention(q, k, v, mask, window, causal=causal, impl=impl)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert not out[2].any()


def test_sliding_window_of_length_one():
    q, k, v = inputs(2, 2, 2, 1, 4)
    expected, _ = reference_attention(q, k, v)
    torch.testing.assert_close(sliding_window_attention(q, k, v, None, 4, causal=True), expected)


def test_sliding_window_memory_grows_linearly():
    """The block kernel's score tensors are (T / b) x b x 3b: linear in T for a fixed window."""
    sizes = []
    for length in (256, 512):
        q, k, v = inputs(1, 1, 1, length, 4)
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel()) or t,
                                                      lambda t: t):
            sliding_window_attention(q.requires_grad_(), k, v, None, 8, causal=False,
                                     impl="naive")
        sizes.append(max(seen))
    assert sizes[1] == 2 * sizes[0]


def test_band_mask_offsets_queries():
    mask = masks.band_mask(2, 5, 2, causal=True, query_offset=3)[0, 0]
    assert mask.tolist() == [[False, True, True, True, False], [False, False, True, True, True]]


def test_int8_quantization_error_is_within_half_a_step():
    x = torch.randn(3, 2, 5, 16) * torch.tensor([0.01, 1.0, 100.0])[:, None, None, None]
    values, scale = quantize_int8(x)
    assert values.dtype == torch.int8 and scale.shape == (3, 2, 5, 1)
    assert ((values.float() * scale - x).abs() <= scale / 2 + 1e-6 * x.abs()).all()


def test_quantized_cache_reorders_values_and_scales():
    cache = QuantizedKVCache(3, 2, 4, 8)
    k = torch.randn(3, 2, 2, 8) * torch.tensor([1.0, 10.0, 100.0])[:, None, None, None]
    cache.update(k, k)
    cache.reorder(torch.tensor([2, 0]))
    keys, _ = cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))
    torch.testing.assert_close(keys[:, :, :2], k[[2, 0]], rtol=0, atol=k.abs().max() / 200)


def test_sliding_cache_keeps_the_last_window():
    cache = SlidingKVCache(1, 1, 3, 2)
    for step in range(5):
        x = torch.full((1, 1, 1, 2), float(step))
        keys, _ = cache.update(x, x)
    assert keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # 3 held + the new one
    assert cache.held == 3 and cache.length == 5
