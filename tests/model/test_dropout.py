"""Dropout with the 16-bit random draw: the rate, the scale, the gradient, determinism."""

import pytest
import torch
import torch.nn.functional as F

from transduce.model.dropout import Dropout, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_drop_rate_and_mean_are_those_of_inverted_dropout(p):
    torch.manual_seed(0)
    n = 1_000_000
    out = dropout(torch.ones(n), p)
    dropped = (out == 0).float().mean().item()
    # 5 standard deviations of a Bernoulli(p) mean over n draws
    assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert out.mean().item() == pytest.approx(1.0, abs=5 * (p / (1 - p) / n) ** 0.5)
    kept = out[out != 0]
    assert torch.all(kept == kept[0]) and kept[0].item() == pytest.approx(1 / (1 - p), rel=1e-4)


def test_mask_bits_are_independent_across_the_four_lanes_of_a_draw():
    torch.manual_seed(1)
    mask, _ = keep_mask((400_000,), 0.5)
    lanes = mask.view(-1, 4).float()
    rates = lanes.mean(0)
    assert torch.all((rates - 0.5).abs() < 0.005)
    both = (lanes[:, 0] * lanes[:, 3]).mean().item()   # lane 3 holds the draw's top bits
    assert both == pytest.approx(0.25, abs=0.005)


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(2)
    x = torch.randn(64, 33, requires_grad=True)
    out = dropout(x, 0.2)
    (grad,) = torch.autograd.grad(out.sum(), x)
    factor = out.detach() / x.detach()
    torch.testing.assert_close(grad, factor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_keeps_the_dtype_and_shape(dtype):
    x = torch.randn(3, 5, 7).to(dtype)
    out = dropout(x, 0.1)
    assert out.dtype == dtype and out.shape == x.shape


def test_the_same_seed_gives_the_same_mask_and_eval_mode_is_identity():
    layer = Dropout(0.25)
    x = torch.randn(10, 10)
    torch.manual_seed(3)
    first = layer(x)
    torch.manual_seed(3)
    assert torch.equal(first, layer(x))
    layer.eval()
    assert layer(x) is x
    assert dropout(x, 0.0) is x
    assert torch.all(dropout(x, 1.0) == 0)


def test_refuses_a_probability_outside_0_1():
    with pytest.raises(ValueError, match="1.5"):
        Dropout(1.5)


def test_matches_torch_dropout_in_distribution_of_the_output_values():
    torch.manual_seed(4)
    x = torch.ones(200_000)
    ours, theirs = dropout(x, 0.1), F.dropout(x, 0.1)
    assert ours.unique().tolist() == pytest.approx(theirs.unique().tolist(), rel=1e-4)
