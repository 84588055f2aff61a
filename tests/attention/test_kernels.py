"""The PyTorch kernels against a float64 reference, forward and gradients."""

import pytest
import torch

from tests.attention.reference import reference_attention
from transduce.attention import attention, flash_attention, masks
from transduce.config import AttentionImpl, choices

# impl='triton' needs a GPU or the interpreter: tests/attention/test_triton.py.
IMPLS = [impl for impl in choices(AttentionImpl) if impl != "triton"]

# (B, H, Hkv, T, S, D): MHA, GQA (H/2), MQA, T != S, T = 1, lengths that are not
# powers of two.
SHAPES = [
    (2, 4, 4, 13, 13, 8),
    (2, 4, 2, 13, 21, 8),
    (3, 6, 1, 7, 19, 16),
    (2, 4, 2, 1, 9, 8),
    (1, 2, 1, 1, 1, 4),
    (2, 8, 4, 37, 29, 16),
]


def make_inputs(B, H, Hkv, T, S, D, dtype=torch.float64):
    q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, dtype=dtype, requires_grad=True)
    return q, k, v


def make_mask(kind, B, H, T, S):
    """A mask of each kind the model uses; 'holes' has fully masked rows and heads."""
    if kind == "none":
        return None
    lengths = torch.randint(1, S + 1, (B,))
    lengths[0] = S
    padding = masks.padding_mask(lengths, S)                              # (B, 1, 1, S)
    if kind == "padding":
        return padding
    holes = (torch.rand(B, H, T, S) > 0.3) & padding
    holes[0, 0, 0] = False            # a fully masked query row
    holes[-1, -1] = False             # a fully masked head
    return holes


def loss_of(out):
    # A non-uniform upstream gradient, so dO is not constant along any axis.
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    return (out * weights).sum() + (out ** 2).sum()


def grads(out, inputs):
    return torch.autograd.grad(loss_of(out), inputs)


CASES = [(shape, kind, causal) for shape in SHAPES for kind in ["none", "padding", "holes"]
         for causal in [False, True]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape,kind,causal", CASES)
def test_float64_forward_and_gradients_match_reference(impl, shape, kind, causal):
    B, H, Hkv, T, S, D = shape
    q, k, v = make_inputs(*shape)
    mask = make_mask(kind, B, H, T, S)
    expected, _ = reference_attention(q, k, v, mask, causal)
    out = attention(q, k, v, mask, causal=causal, impl=impl)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(grads(out, (q, k, v)), grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


@pytest.mark.parametrize("impl", ["naive", "sdpa"])
@pytest.mark.parametrize("shape,kind,causal", CASES[::2] + CASES[1::6])
def test_soft_capped_scores_match_reference_forward_and_gradients(impl, shape, kind, causal):
    """Gemma 2's cap, low enough that tanh bends most scores (inputs of unit variance
    give scores of about 1 here): forward and gradients against float64's formula; sdpa
    computes it in the written-out form."""
    B, H, Hkv, T, S, D = shape
    q, k, v = make_inputs(*shape)
    mask = make_mask(kind, B, H, T, S)
    expected, _ = reference_attention(q, k, v, mask, causal, softcap=0.7)
    out = attention(q, k, v, mask, causal=causal, impl=impl, softcap=0.7)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(grads(out, (q, k, v)), grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    if S > 1:
        uncapped, _ = reference_attention(q, k, v, mask, causal)
        assert not torch.allclose(out, uncapped, atol=1e-3)


@pytest.mark.parametrize("impl", ["flash", "triton"])
def test_the_tiled_kernels_refuse_a_soft_cap_by_name(impl):
    q, k, v = make_inputs(1, 2, 1, 3, 3, 4)
    with pytest.raises(ValueError, match=f"softcap needs the scores written out: impl "
                                         f"'sdpa' or 'naive', not '{impl}'"):
        attention(q, k, v, impl=impl, softcap=1.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_matches_float64_reference(impl, shape):
    B, H, Hkv, T, S, D = shape
    q, k, v = make_inputs(*shape, dtype=torch.float32)
    mask = make_mask("holes", B, H, T, S)
    out = attention(q, k, v, mask, causal=True, impl=impl)
    expected, _ = reference_attention(q, k, v, mask, causal=True)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)
    for got, want in zip(grads(out, (q, k, v)), grads(expected, (q, k, v))):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (4, 8), (16, 5), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_tiles_that_do_not_divide_the_lengths(block_q, block_k, causal):
    shape = (2, 6, 2, 23, 41, 8)
    B, H, Hkv, T, S, D = shape
    q, k, v = make_inputs(*shape)
    mask = make_mask("holes", B, H, T, S)
    out = flash_attention(q, k, v, mask, causal=causal, scale=D ** -0.5,
                          block_q=block_q, block_k=block_k)
    expected, _ = reference_attention(q, k, v, mask, causal)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(grads(out, (q, k, v)), grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_flash_causal_with_more_queries_than_keys_gives_zero_rows():
    # T > S: the first T - S queries precede every key.
    q, k, v = make_inputs(1, 2, 2, 9, 4, 8)
    out = flash_attention(q, k, v, causal=True, scale=8 ** -0.5, block_q=2, block_k=2)
    expected, _ = reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert torch.all(out[:, :, :5] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_are_zero_with_finite_gradients(impl):
    q, k, v = make_inputs(2, 4, 2, 5, 6, 8, dtype=torch.float32)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    mask[1, 0, 2] = False
    out = attention(q, k, v, mask, impl=impl)
    assert torch.all(out[1, :, 2] == 0)
    dq, dk, dv = grads(out, (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.all(dq[1, :, 2] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_batched_equals_one_sequence_at_a_time(impl):
    q, k, v = make_inputs(3, 4, 2, 6, 9, 8, dtype=torch.float32)
    lengths = torch.tensor([9, 4, 7])
    mask = masks.padding_mask(lengths, 9)
    batched = attention(q, k, v, mask, causal=False, impl=impl)
    for b in range(3):
        n = int(lengths[b])
        alone = attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], impl=impl)
        torch.testing.assert_close(batched[b:b + 1], alone, rtol=0, atol=1e-6)


def test_naive_returns_the_reference_weights():
    q, k, v = make_inputs(2, 4, 2, 5, 7, 8)
    mask = make_mask("holes", 2, 4, 5, 7)
    out, weights = attention(q, k, v, mask, causal=True, impl="naive", return_weights=True)
    _, expected = reference_attention(q, k, v, mask, causal=True)
    assert weights.shape == (2, 4, 5, 7)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)


def test_bfloat16_flash_is_close_to_reference():
    q, k, v = make_inputs(1, 4, 2, 40, 70, 16, dtype=torch.bfloat16)
    out = flash_attention(q, k, v, causal=True, scale=0.25, block_q=16, block_k=32)
    expected, _ = reference_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=3e-2)


def test_flash_dropout_gradients_are_exact_for_a_fixed_seed():
    # The backward regenerates the forward's dropout pattern tile by tile.
    q, k, v = make_inputs(1, 2, 1, 6, 7, 4)
    mask = make_mask("padding", 1, 2, 6, 7)

    def fn(q, k, v):
        return flash_attention(q, k, v, mask, causal=True, scale=0.5, dropout_p=0.3,
                               seed=1234, block_q=4, block_k=3)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_flash_dropout_keeps_the_expected_output():
    # Uniform scores over 4096 keys and v = 1: each output is the rescaled fraction kept.
    q = torch.zeros(1, 8, 16, 8)
    k = torch.randn(1, 8, 4096, 8)
    v = torch.ones(1, 8, 4096, 8)
    out = flash_attention(q, k, v, scale=1.0, dropout_p=0.5, seed=3)
    assert abs(out.mean().item() - 1.0) < 0.01
    assert 0.01 < out.std().item() < 0.03          # sqrt(p / (1 - p) / S) = 0.0156
    again = flash_attention(q, k, v, scale=1.0, dropout_p=0.5, seed=3)
    assert torch.equal(out, again)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_is_off_at_zero_and_on_otherwise(impl):
    q, k, v = make_inputs(1, 2, 2, 4, 50, 8, dtype=torch.float32)
    assert torch.equal(attention(q, k, v, impl=impl), attention(q, k, v, impl=impl))
    dropped = attention(q, k, v, impl=impl, dropout_p=0.5)
    assert not torch.allclose(dropped, attention(q, k, v, impl=impl))


@pytest.mark.parametrize("kwargs,message", [
    ({"impl": "fast"}, "unknown attention impl"),
    ({"impl": "sdpa", "return_weights": True}, "impl='naive'"),
    ({"impl": "flash", "return_weights": True}, "impl='naive'"),
    ({"dropout_p": 1.0}, "dropout_p"),
])
def test_bad_arguments_are_named(kwargs, message):
    q, k, v = make_inputs(1, 2, 2, 3, 3, 4)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, **kwargs)


def test_bad_shapes_and_masks_are_named():
    q, k, v = make_inputs(1, 4, 2, 3, 5, 4)
    with pytest.raises(ValueError, match="grouped over 3"):
        attention(q, torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4))
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="boolean"):
        attention(q, k, v, torch.ones(1, 1, 1, 5))
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(q, k, v, torch.ones(1, 3, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="grouped over 0"):
        attention(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="one floating-point dtype; got torch.float64, "
                                         "torch.float32"):
        attention(q, k.float(), v)
    with pytest.raises(ValueError, match="floating-point"):
        attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="one device; got cpu, meta"):
        attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="boolean .* got list"):
        attention(q, k, v, [[True] * 5])


@pytest.mark.parametrize("kwargs,message", [
    ({"mask": torch.ones(1, 1, 1, 5)}, "boolean"),
    ({"mask": torch.ones(1, 3, 1, 5, dtype=torch.bool)}, "does not broadcast"),
    ({"block_q": 0}, "block_q=0 must be a positive"),
    ({"block_k": 2.5}, "block_k=2.5 must be a positive"),
    ({"dropout_p": -0.1}, "dropout_p"),
    ({"position_bias": torch.zeros(4, 3)}, "position_bias"),
])
def test_flash_attention_called_directly_names_bad_arguments(kwargs, message):
    q, k, v = make_inputs(1, 4, 2, 3, 5, 4)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, scale=0.5, **kwargs)


def test_flash_attention_called_directly_names_bad_shapes_and_segments():
    q, k, v = make_inputs(1, 4, 2, 3, 5, 4)
    with pytest.raises(ValueError, match="grouped over 3"):
        flash_attention(q, torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4), scale=0.5)
    with pytest.raises(ValueError, match="give Segments to attention"):
        flash_attention(q, k, v, masks.Segments(torch.zeros(1, 3, dtype=torch.long),
                                                torch.zeros(1, 5, dtype=torch.long)), scale=0.5)


@pytest.mark.parametrize("kind", ["none", "padding", "holes"])
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_training_form_matches_float64_within_bfloat16_rounding(kind, causal):
    # bfloat16 inputs that need gradients on a CPU take the matrix-product form (under
    # autocast, as training runs it): forward and gradients against float64.
    shape = (3, 4, 2, 11, 11, 16)
    B, H, Hkv, T, S, D = shape
    q, k, v = (x.detach().to(torch.bfloat16).requires_grad_() for x in make_inputs(*shape))
    mask = make_mask(kind, B, H, T, S)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, mask, causal=causal, impl="sdpa")
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected, _ = reference_attention(*exact, mask, causal)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=3e-2)
    upstream = torch.randn_like(expected)
    got = torch.autograd.grad(out, (q, k, v), upstream.to(out.dtype))
    for g, w in zip(got, torch.autograd.grad(expected, exact, upstream)):
        assert torch.linalg.norm(g.double() - w) <= 2e-2 * torch.linalg.norm(w) + 1e-6


def test_bfloat16_training_on_cpu_takes_the_matrix_product_form_up_to_its_length(monkeypatch):
    from transduce.attention import kernels

    calls = []
    real = kernels._naive
    monkeypatch.setattr(kernels, "_naive",
                        lambda *a, **kw: calls.append(a[1].shape[2]) or real(*a, **kw))
    for keys in (8, kernels.MATMUL_FORM_MAX_KEYS + 1):
        q, k, v = (x.detach().to(torch.bfloat16).requires_grad_()
                   for x in make_inputs(1, 2, 2, 4, keys, 8))
        attention(q, k, v, impl="sdpa")
        with torch.no_grad():
            attention(q, k, v, impl="sdpa")          # inference keeps the fused kernel
    assert calls == [8]
