import math

import pytest
import torch

from transduce.model.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                                        SinusoidalPositionalEncoding, sinusoidal_table)


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
