import math

import pytest
import torch

from transduce.model.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                                        SinusoidalPositionalEncoding, partial_rotary_order,
                                        rotary_frequencies, sinusoidal_table)


@pytest.mark.parametrize("d_model", [8, 7])
def test_sinusoidal_table_matches_the_formula(d_model):
    table = sinusoidal_table(50, d_model)
    for pos in range(50):
        for i in range(d_model):
            angle = pos / 10000 ** (2 * (i // 2) / d_model)
            expected = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert abs(table[pos, i].item() - expected) < 1e-6


def test_sinusoidal_module_slices_positions_and_names_the_limit():
    module = SinusoidalPositionalEncoding(16, max_positions=10)
    torch.testing.assert_close(module(3, start=4), sinusoidal_table(10, 16)[4:7])
    assert "table" not in module.state_dict()  # derived, never saved
    with pytest.raises(ValueError, match="max_positions=10"):
        module(5, start=6)


def test_learned_positions_are_trainable_and_bounded():
    module = LearnedPositionalEmbedding(16, max_positions=8)
    assert module(8).shape == (8, 16) and module.embedding.weight.requires_grad
    with pytest.raises(ValueError, match="max_positions=8"):
        module(9)


def test_rope_preserves_norms():
    rope = RotaryEmbedding(16, max_positions=64)
    x = torch.randn(2, 3, 20, 16)
    rotated = rope(x, start=7)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope(x[:, :, :1], start=0), x[:, :, :1])  # position 0: identity


def test_rope_dot_products_depend_only_on_relative_position():
    rope = RotaryEmbedding(16, max_positions=200)
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(m, n):
        return (rope(q, start=m) * rope(k, start=n)).sum().item()

    for offset in [0, 3, 17]:
        reference = score(offset, 0)
        for shift in [1, 40, 150]:
            assert abs(score(offset + shift, shift) - reference) < 1e-5  # float32 tables
    assert abs(score(5, 0) - score(0, 5)) > 1e-3  # and it does depend on the direction


def test_rope_needs_an_even_head_size():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7, 10)


def neox_partial_rotary(x: torch.Tensor, position: int, rotary_dims: int,
                        base: float) -> torch.Tensor:
    """GPT-NeoX's rotation of the first rotary_dims features (pairs (i, i + R/2)), the
    others as they are, written from its definition in float64: x (..., D)."""
    rates = base ** (-torch.arange(0, rotary_dims, 2, dtype=torch.float64) / rotary_dims)
    angle = position * torch.cat([rates, rates])
    rotated, rest = x[..., :rotary_dims], x[..., rotary_dims:]
    first, second = rotated.chunk(2, dim=-1)
    turned = rotated * angle.cos() + torch.cat([-second, first], dim=-1) * angle.sin()
    return torch.cat([turned, rest], dim=-1)


@pytest.mark.parametrize("head_dim,rotary_dims", [(16, 4), (16, 8), (12, 6), (16, 16)])
def test_partial_rotary_positions_in_our_order_give_gpt_neox_s_scores(head_dim, rotary_dims):
    """Queries and keys reordered by partial_rotary_order, turned by the tables of
    rotary_frequencies(rotary_dims=R), are GPT-NeoX's rotated ones reordered: every
    score is its, and the features past R carry no position."""
    order = partial_rotary_order(head_dim, rotary_dims)
    assert sorted(order.tolist()) == list(range(head_dim))
    rates = rotary_frequencies(head_dim, 500.0, rotary_dims=rotary_dims)
    assert (rates[rotary_dims // 2:] == 0).all()
    rope = RotaryEmbedding(head_dim, max_positions=64, inv_freq=rates)
    q, k = torch.randn(2, 1, 1, head_dim, dtype=torch.float64).unbind(0)
    for m, n in ((0, 0), (5, 2), (40, 17)):
        theirs_q, theirs_k = neox_partial_rotary(q, m, rotary_dims, 500.0), \
            neox_partial_rotary(k, n, rotary_dims, 500.0)
        ours_q, ours_k = rope(q[..., order], start=m), rope(k[..., order], start=n)
        # (our tables are float32's)
        torch.testing.assert_close(ours_q, theirs_q[..., order], atol=1e-5, rtol=0)
        torch.testing.assert_close((ours_q * ours_k).sum(), (theirs_q * theirs_k).sum(),
                                   atol=1e-5, rtol=0)
