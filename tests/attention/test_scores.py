"""RNN-era attention scores against the formulas written out in float64."""

import pytest
import torch

from transduce.attention import AdditiveAttention, DotAttention, GeneralAttention


def softmax_with_mask(scores, mask):
    out = torch.zeros_like(scores)
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            allowed = mask[b, min(t, mask.shape[1] - 1)]
            if allowed.any():
                out[b, t, allowed] = torch.softmax(scores[b, t, allowed], dim=0)
    return out


def inputs(query_dim=6, key_dim=6, value_dim=5):
    query = torch.randn(2, 3, query_dim, dtype=torch.float64)
    keys = torch.randn(2, 7, key_dim, dtype=torch.float64)
    values = torch.randn(2, 7, value_dim, dtype=torch.float64)
    mask = torch.ones(2, 1, 7, dtype=torch.bool)
    mask[1, 0, 4:] = False
    return query, keys, values, mask


def test_additive_matches_the_formula():
    attn = AdditiveAttention(6, 4, 8).double()
    query, keys, values, mask = inputs(key_dim=4)
    context, weights = attn(query, keys, values, mask)
    scores = torch.empty(2, 3, 7, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            for s in range(7):
                hidden = torch.tanh(attn.query_proj.weight @ query[b, t] + attn.key_proj.weight @ keys[b, s])
                scores[b, t, s] = attn.score.weight[0] @ hidden
    expected = softmax_with_mask(scores, mask)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(context, expected @ values, rtol=0, atol=1e-12)
    assert torch.all(weights[1, :, 4:] == 0)
    again, _ = attn(query, keys, values, mask, projected_keys=attn.project_keys(keys))
    torch.testing.assert_close(again, context, rtol=0, atol=0)


def test_dot_matches_the_formula():
    query, keys, values, mask = inputs()
    context, weights = DotAttention()(query, keys, values, mask)
    expected = softmax_with_mask(query @ keys.transpose(1, 2), mask)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(context, expected @ values, rtol=0, atol=1e-12)


def test_general_matches_the_formula():
    attn = GeneralAttention(6, 4).double()
    query, keys, values, mask = inputs(key_dim=4)
    context, weights = attn(query, keys, values, mask)
    W = attn.key_proj.weight                                  # (query_dim, key_dim)
    scores = torch.einsum("btq,qk,bsk->bts", query, W, keys)
    expected = softmax_with_mask(scores, mask)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(context, expected @ values, rtol=0, atol=1e-12)


def test_fully_masked_source_gives_zero_context():
    query, keys, values, _ = inputs()
    mask = torch.zeros(2, 1, 7, dtype=torch.bool)
    context, weights = DotAttention()(query, keys, values, mask)
    assert torch.all(context == 0) and torch.all(weights == 0)


def test_dot_with_unequal_sizes_is_a_clear_error():
    query, keys, values, mask = inputs(key_dim=4)
    with pytest.raises(ValueError, match="GeneralAttention"):
        DotAttention()(query, keys, values, mask)
