"""LayerNorm(x + dropout(y)) by the Triton kernels against the float64 formula, forward
and gradients; and post-norm layers with impl="triton" taking them while training.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with one, on CUDA."""

import os

import pytest
import torch
import torch.nn.functional as F

from transduce.config import preset
from transduce.model import add_norm, build_model
from transduce.model.add_norm import add_dropout_norm, fused_add_dropout_norm, keep_mask
from transduce.model.dropout import Dropout

pytest.importorskip("triton")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("the Triton kernels run on CUDA or in Triton's interpreter",
                allow_module_level=True)


def leaves(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)


def float64_reference(x, y, weight, bias, keep, p, grad_out):
    """-> the formula's output and its gradients for x, y, weight (and bias), in float64."""
    x64, y64, w64 = (t.detach().cpu().double().requires_grad_() for t in (x, y, weight))
    b64 = None if bias is None else bias.detach().cpu().double().requires_grad_()
    out = F.layer_norm(x64 + y64 * keep.double() / (1 - p), (x.shape[-1],), w64, b64, 1e-5)
    inputs = [x64, y64, w64] + ([] if b64 is None else [b64])
    return out, torch.autograd.grad(out, inputs, grad_out.double())


@pytest.mark.parametrize("shape", [(13, 24), (2, 7, 40), (1, 1, 16), (9, 100)])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_the_float64_formula(shape, p, bias):
    torch.manual_seed(0)
    x, y = leaves(*shape), leaves(*shape)
    weight, b = leaves(shape[-1]), leaves(shape[-1]) if bias else None
    torch.manual_seed(7)
    out = fused_add_dropout_norm(x, y, weight, b, 1e-5, p)
    torch.manual_seed(7)                            # the seed the call drew
    seed = torch.randint(0, 2**31 - 1, (1,), device=DEVICE)
    rows = x.numel() // shape[-1]
    keep = keep_mask(rows, shape[-1], p, seed).view(shape) if p else torch.ones(shape).bool()
    grad_out = torch.randn(shape, device=DEVICE)
    inputs = [x, y, weight] + ([b] if bias else [])
    got = torch.autograd.grad(out, inputs, grad_out)
    expected, expected_grads = float64_reference(x, y, weight, b, keep.cpu(), p, grad_out.cpu())
    assert out.shape == shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=2e-6)
    for name, g, want in zip(["x", "y", "weight", "bias"], got, expected_grads):
        torch.testing.assert_close(g.double().cpu(), want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"d{name}: {m}")  # noqa: B023


def test_a_bfloat16_sublayer_output_on_a_float32_residual_gives_autocasts_dtypes():
    """Under autocast, as in training: y (a product's output) bfloat16, x the float32
    residual stream; out float32 as autocast's layer_norm gives, each gradient in its
    input's dtype."""
    torch.manual_seed(1)
    x, y = leaves(6, 32), leaves(6, 32, dtype=torch.bfloat16)
    weight, b = leaves(32), leaves(32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fused_add_dropout_norm(x, y, weight, b, 1e-5, 0.0)
    grad_out = torch.randn(6, 32, device=DEVICE)
    dx, dy, dw, db = torch.autograd.grad(out, (x, y, weight, b), grad_out)
    expected, want = float64_reference(x, y, weight, b, torch.ones(6, 32).bool(), 0.0,
                                       grad_out.cpu())
    assert (out.dtype, dx.dtype, dy.dtype, dw.dtype) == \
        (torch.float32, torch.float32, torch.bfloat16, torch.float32)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(dy.double().cpu(), want[1], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dw.double().cpu(), want[2], rtol=1e-5, atol=1e-5)


def test_dropout_keeps_about_one_minus_p_and_follows_torchs_generator():
    x, y = torch.zeros(32, 128, device=DEVICE), torch.ones(32, 128, device=DEVICE)
    seeds = [torch.randint(0, 2**31 - 1, (1,), device=DEVICE) for _ in range(2)]
    masks = [keep_mask(32, 128, 0.25, seed) for seed in seeds]
    kept = masks[0].float().mean().item()
    assert abs(kept - 0.75) < 4 * (0.75 * 0.25 / masks[0].numel()) ** 0.5
    assert not torch.equal(*masks)
    weight = torch.ones(128, device=DEVICE)
    torch.manual_seed(3)
    first = fused_add_dropout_norm(x, y, weight, None, 1e-5, 0.25)
    torch.manual_seed(3)
    assert torch.equal(first, fused_add_dropout_norm(x, y, weight, None, 1e-5, 0.25))


def test_only_training_post_norm_layers_with_layer_norms_take_the_kernels(monkeypatch):
    calls = []
    real = add_norm.fused_add_dropout_norm
    monkeypatch.setattr(add_norm, "fused_add_dropout_norm",
                        lambda *args: calls.append(args) or real(*args))
    x, y = torch.randn(3, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    norm, dropout = torch.nn.LayerNorm(16).to(DEVICE), Dropout(0.0)
    plain = norm(x + y)
    for fused, training, module in [(True, False, norm), (False, True, norm),
                                    (True, True, torch.nn.RMSNorm(16).to(DEVICE))]:
        dropout.train(training)
        add_dropout_norm(x, y, module, dropout, fused)
    assert calls == []
    dropout.train()
    torch.testing.assert_close(add_dropout_norm(x, y, norm, dropout, True), plain,
                               rtol=0, atol=1e-6)
    assert len(calls) == 1
    # Where they cannot run (a CPU outside the interpreter), PyTorch's ops, no error: a
    # model with impl "triton" whose attention never calls Triton trains there.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cpu":
        torch.testing.assert_close(add_dropout_norm(x, y, norm, dropout, True), plain)
        assert len(calls) == 1


def test_a_post_norm_translation_model_with_impl_triton_trains_as_with_pytorchs_ops(
        monkeypatch):
    """Encoder and decoder layers (cross-attention too) end each sub-layer in the kernels
    while training; loss and every gradient as the same model's with the kernels off.
    (Its attention is SDPA's here, the interpreter's attention being slow; impl
    "triton" is what turns the kernels on.)"""
    calls = []
    real = add_norm.fused_add_dropout_norm
    monkeypatch.setattr(add_norm, "fused_add_dropout_norm",
                        lambda *args: calls.append(args) or real(*args))
    layers = lambda model: [*model.encoder.layers, *model.decoder.layers]  # noqa: E731
    triton = build_model(preset("tiny", src_vocab_size=50, tgt_vocab_size=50,
                                attention_impl="triton"))
    assert all(layer.fused_add_norm for layer in layers(triton))
    torch.manual_seed(0)
    model = build_model(preset("tiny", src_vocab_size=50, tgt_vocab_size=50))
    model = model.to(DEVICE).train()
    for layer in layers(model):
        layer.fused_add_norm = True
    src = torch.randint(4, 50, (2, 9), device=DEVICE)
    tgt = torch.randint(4, 50, (2, 7), device=DEVICE)

    def loss_and_grads():
        loss = model(src, tgt).float().square().mean()
        return [loss, *torch.autograd.grad(loss, list(model.parameters()))]

    fused = loss_and_grads()
    assert len(calls) == 2 * 2 + 3 * 2         # two encoder layers, two decoder layers
    for layer in layers(model):
        layer.fused_add_norm = False
    for got, want in zip(fused, loss_and_grads()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(calls) == 10
