"""Relative position biases (T5, ALiBi) and every kernel's handling of an additive bias,
against a float64 reference that adds the dense (H, T, S) bias to the scores."""

import math

import pytest
import torch

from tests.attention.test_kernels import grads, make_inputs, make_mask
from transduce.attention import attention, flash_attention
from transduce.attention.position_bias import ALiBi, T5Bias, alibi_slopes, distances, expand

IMPLS = ["naive", "sdpa", "flash"]   # triton: tests/attention/test_triton.py
SHAPES = [(2, 4, 4, 13, 13, 8), (2, 4, 2, 9, 21, 8), (3, 6, 1, 7, 19, 16), (2, 4, 2, 1, 9, 8)]


def reference_with_bias(q, k, v, mask, causal, vector):
    """The formula in float64: softmax(q k^T / sqrt(D) + dense bias, masked) v."""
    q, k, v, vector = (x.double() for x in (q, k, v, vector))
    B, H, T, D = q.shape
    S = k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    dense = torch.empty(H, T, S, dtype=torch.float64)
    for t in range(T):
        for s in range(S):
            dense[:, t, s] = vector[:, (t + S - T) - s + T - 1]   # distance + T - 1
    allowed = torch.ones(B, H, T, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & (torch.arange(S)[None, :] <= torch.arange(T)[:, None] + S - T)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D) + dense).masked_fill(~allowed, -math.inf)
    has_key = allowed.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), -1).masked_fill(~has_key, 0.0)
    return weights @ v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind,causal", [("none", False), ("holes", False), ("padding", True),
                                         ("holes", True)])
def test_every_kernel_adds_the_bias_like_the_float64_reference(impl, shape, kind, causal):
    B, H, Hkv, T, S, D = shape
    q, k, v = make_inputs(*shape)
    vector = torch.randn(H, T + S - 1, dtype=torch.float64, requires_grad=True)
    mask = make_mask(kind, B, H, T, S)
    if impl == "flash":   # tiles that do not divide the lengths
        out = flash_attention(q, k, v, mask, causal=causal, scale=D ** -0.5, block_q=4,
                              block_k=5, position_bias=vector)
    else:
        out = attention(q, k, v, mask, causal=causal, impl=impl, position_bias=vector)
    expected = reference_with_bias(q, k, v, mask, causal, vector)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    for got, want in zip(grads(out, (q, k, v, vector)), grads(expected, (q, k, v, vector))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_float32_sdpa_with_bias_has_zero_rows_where_no_key_is_visible():
    q, k, v = make_inputs(1, 2, 2, 4, 6, 8, dtype=torch.float32)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = attention(q, k, v, mask, impl="sdpa", position_bias=torch.randn(2, 9))
    assert torch.equal(out[0, :, 1], torch.zeros(2, 8))
    dq, = torch.autograd.grad(out.sum(), (q,))
    assert torch.isfinite(dq).all() and torch.equal(dq[0, :, 1], torch.zeros(2, 8))


def test_expand_reads_each_distance():
    vector = torch.arange(2 * 6, dtype=torch.float32).view(2, 6)        # T = 2, S = 5
    dense = expand(vector, 2, 5)
    assert dense.shape == (2, 2, 5)
    assert distances(2, 5).tolist() == [-1, 0, 1, 2, 3, 4]
    # query 1 sits at position 4 (aligned with the last key): distance to key 0 is 4
    assert dense[0, 1, 0] == vector[0, 4 + 1] and dense[1, 0, 4] == vector[1, -1 + 1]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (16, 64), (8, 20)])
def test_t5_buckets_equal_transformers(bidirectional, buckets, max_distance):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    relative = torch.arange(-300, 301)          # key position - query position, T5's sign
    theirs = t5.T5Attention._relative_position_bucket(relative, bidirectional=bidirectional,
                                                      num_buckets=buckets,
                                                      max_distance=max_distance)
    ours = T5Bias(4, bidirectional=bidirectional, num_buckets=buckets,
                  max_distance=max_distance).bucket(-relative)
    assert torch.equal(ours, theirs)


def test_t5_vector_is_the_table_row_of_each_distance_and_learns():
    bias = T5Bias(3, bidirectional=True, num_buckets=8, max_distance=20)
    vector = bias(4, 7)                                                   # (3, 10)
    buckets = bias.bucket(distances(4, 7))
    assert torch.equal(vector, bias.table.weight[buckets].T)
    vector.sum().backward()
    assert bias.table.weight.grad.abs().sum() > 0


def test_alibi_slopes_are_the_papers():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads
    twelve = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -(i / 2) for i in (1, 3, 5, 7)]
    assert torch.allclose(alibi_slopes(12), torch.tensor(twelve))
    vector = ALiBi(8)(3, 5)
    assert torch.equal(vector[:, 2], torch.zeros(8))                     # distance 0
    assert torch.allclose(vector[0], -0.5 * distances(3, 5).abs().float())


def test_bad_bias_shapes_are_named():
    q, k, v = make_inputs(1, 2, 2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"\(H, T \+ S - 1\) = \(2, 7\)"):
        attention(q, k, v, position_bias=torch.zeros(2, 5))
