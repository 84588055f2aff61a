"""Global and strided sparse attention on the block kernel against the masked dense
reference, forward and gradients; the cached steps against the full pass."""

import pytest
import torch

from tests.attention.test_kernels import grads, make_inputs
from transduce.attention import MultiHeadAttention, attention, masks
from transduce.attention.sparse import Pattern, pattern_attention

PATTERNS = [Pattern(window=2, global_tokens=1), Pattern(window=3, global_tokens=4),
            Pattern(window=4, stride=4), Pattern(window=2, stride=2)]


def padding(lengths, length):
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]          # (B, T)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads,length", [(4, 4, 37), (4, 2, 9), (2, 1, 1), (4, 2, 16)])
def test_block_kernel_equals_the_masked_dense_reference(pattern, causal, heads, kv_heads, length):
    q, k, v = make_inputs(2, heads, kv_heads, length, length, 8)
    key_mask = padding([length, max(1, length - 5)], length)
    out = pattern_attention(q, k, v, key_mask, pattern, causal=causal, impl="naive")
    dense = masks.combine(pattern.mask(length, length, causal=causal), key_mask[:, None, None])
    expected = attention(q, k, v, dense, impl="naive")
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(grads(out, (q, k, v)), grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_the_patterns_are_what_they_say():
    strided = Pattern(window=1, stride=3).mask(7, 7, causal=True)[0, 0]
    assert strided[6].tolist() == [False, False, True, False, False, True, True]
    global_ = Pattern(window=1, global_tokens=2).mask(6, 6, causal=False)[0, 0]
    assert global_[0].all() and global_[1].all()                        # global queries
    assert global_[4].tolist() == [True, True, False, True, True, True]  # global keys + window


@pytest.mark.parametrize("kind", ["global", "strided"])
def test_cached_steps_equal_the_full_pass(kind):
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, kind=kind, window=2).eval()
    x = torch.randn(2, 11, 16)
    with torch.no_grad():
        full = layer(x, causal=True)
        cache = layer.kind.new_cache(2, 2, 4, 11, torch.float32, "cpu")
        steps = [layer(x[:, :4], causal=True, cache=cache)]
        steps += [layer(x[:, t:t + 1], causal=True, cache=cache) for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-6)
