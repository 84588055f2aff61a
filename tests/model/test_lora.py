"""LoRA adapters (model/lora.py): the layer against its formula in float64 and against
torch.autograd's gradients, the model with adapters against its merged copy in all
three shapes, what is frozen, and the refusals."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from transduce.config import ConfigError, parse_lora_targets, preset
from transduce.model import build_model
from transduce.model.lora import (LoRALinear, LoRASettings, _MergedLoRA, adapter_layers,
                                  adapter_weights, add_adapters, merge_adapters,
                                  merged_weights)
from transduce.model.packed import decoding_copy

VOCAB = 300


def randomized(model):
    """Adapters with B drawn too (B = 0 at first would hide a wrong product)."""
    torch.manual_seed(5)
    with torch.no_grad():
        for layer in adapter_layers(model).values():
            layer.lora_b.normal_(std=0.1)
    return model


def test_layer_is_its_formula_in_float64():
    torch.manual_seed(0)
    base = nn.Linear(12, 7).double()
    layer = LoRALinear(base, LoRASettings(rank=3, alpha=6.0))
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    expected = x @ base.weight.T + base.bias + 2.0 * (x @ layer.lora_a.T) @ layer.lora_b.T
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.merged_weight(),
                               base.weight + 2.0 * layer.lora_b @ layer.lora_a)
    # The weight and bias are the base's own parameters, frozen; the adapters train.
    assert layer.weight is base.weight and layer.bias is base.bias
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    assert torch.autograd.gradcheck(lambda a, b: torch.nn.functional.linear(
        torch.nn.functional.linear(x, a), b).sum(), (layer.lora_a.detach().requires_grad_(),
                                                      layer.lora_b.detach().requires_grad_()))
    layer(x).sum().backward()
    expected_b = 2.0 * (x @ layer.lora_a.T).reshape(-1, 3).sum(0).expand(7, 3)
    torch.testing.assert_close(layer.lora_b.grad, expected_b)
    assert base.weight.grad is None
    # With dropout, the adapters' input is dropped and the frozen product's is not.
    dropping = LoRALinear(base, LoRASettings(rank=3, alpha=6.0, dropout=0.5))
    with torch.no_grad():
        dropping.lora_b.copy_(layer.lora_b)
        dropping.lora_a.copy_(layer.lora_a)
    torch.manual_seed(4)
    got = dropping(x)
    torch.manual_seed(4)
    dropped = torch.nn.functional.dropout(x, 0.5)
    expected = x @ base.weight.T + base.bias + 2.0 * (dropped @ layer.lora_a.T) @ layer.lora_b.T
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dropping.eval()(x), layer(x), rtol=1e-12, atol=1e-12)


def two_paths(layer, x):
    """The layer as its formula's two products: the reference of the one-product path."""
    update = F.linear(F.linear(x, layer.lora_a), layer.lora_b)
    return F.linear(x, layer.weight, layer.bias) + layer.scale * update


def test_the_one_product_path_against_autograd():
    """Frozen weights and no dropout: the merged product and its own backward pass,
    checked by gradcheck in float64 and against the two products under bfloat16
    autocast (the dtype training runs in)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    weight, bias = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x, a, b: _MergedLoRA.apply(x, weight.to, bias, a, b, 1.5), (x, a, b))
    layer = LoRALinear(nn.Linear(64, 48), LoRASettings(rank=4, alpha=8.0))
    with torch.no_grad():
        layer.lora_b.normal_()
    inputs = torch.randn(2, 16, 64)
    grads = []
    for run in (layer, lambda x: two_paths(layer, x)):
        x = inputs.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        grads.append((out.detach().float(), x.grad, layer.lora_a.grad, layer.lora_b.grad))
        assert x.grad.dtype == torch.float32 and layer.lora_a.grad.dtype == torch.float32
        layer.zero_grad(set_to_none=True)
    for ours, reference in zip(*grads):
        torch.testing.assert_close(ours, reference, rtol=0.03, atol=0.03 * reference.abs().max())


def test_a_new_adapter_changes_nothing():
    torch.manual_seed(0)
    base = nn.Linear(16, 16)
    x = torch.randn(3, 16)
    before = base(x)
    layer = LoRALinear(base, LoRASettings(rank=4, alpha=16.0, dropout=0.5)).eval()
    assert torch.equal(layer(x), before)
    assert torch.count_nonzero(layer.lora_a) == layer.lora_a.numel()    # A is drawn


def run(model, arch):
    """Logits (or hidden states) of a fixed batch, in float64."""
    torch.manual_seed(3)
    ids = torch.randint(4, VOCAB, (2, 7))
    if arch == "transformer":
        return model(ids, torch.randint(4, VOCAB, (2, 5)))
    return model(ids)          # a language model's logits, an encoder's hidden states


@pytest.mark.parametrize("name, arch", [("tiny", "transformer"), ("gpt-tiny", "decoder"),
                                        ("llama-tiny", "decoder"), ("bert-tiny", "encoder")])
def test_the_merged_model_is_the_adapted_one(name, arch):
    torch.manual_seed(1)
    model = build_model(preset(name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                               dropout=0.0)).double().eval()
    plain = copy.deepcopy(model)
    names = add_adapters(model, LoRASettings(rank=4, alpha=8.0))
    # Every attention projection (self and cross) and feed-forward matrix, nothing else.
    linears = [n for n, m in plain.named_modules() if type(m) is nn.Linear
               and n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "out_proj",
                                            "linear1", "linear2", "linear3")]
    assert sorted(names) == sorted(linears) and names
    randomized(model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{n}.{part}" for n in names for part in ("lora_a", "lora_b")}
    # The state dict keeps every name the plain model has, the adapters beside them.
    assert set(model.state_dict()) - set(plain.state_dict()) == set(adapter_weights(model))
    merged = merged_weights(model)
    assert merged.keys() == plain.state_dict().keys()
    adapted = run(model, arch)
    assert not torch.allclose(adapted, run(plain, arch))
    plain.load_state_dict(merged)
    torch.testing.assert_close(run(plain, arch), adapted, rtol=1e-10, atol=1e-10)
    merge_adapters(model)
    assert not adapter_layers(model)
    torch.testing.assert_close(run(model, arch), adapted, rtol=1e-10, atol=1e-10)


def test_targets_choose_the_layers():
    model = build_model(preset("llama-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))
    names = add_adapters(model, LoRASettings(rank=2, alpha=2.0, targets=("q", "v")))
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "v_proj"}
    assert len(names) == 2 * model.config.num_decoder_layers


def test_a_decoding_copy_merges_the_adapters():
    """Decoding fuses q, k, v into one product, which reads the weights directly: the copy
    is merged first, and the fusion refuses layers with adapters."""
    torch.manual_seed(1)
    model = build_model(preset("gpt-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)).eval()
    add_adapters(model, LoRASettings(rank=4, alpha=8.0))
    randomized(model)
    copied = decoding_copy(model, torch.float32, "cpu")
    assert not adapter_layers(copied) and adapter_layers(model)
    ids = torch.randint(4, VOCAB, (1, 6))
    torch.testing.assert_close(copied(ids), model(ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="LoRALinear"):
        model.decoder.layers[0].self_attn.fuse_self_projections()


def test_refusals():
    with pytest.raises(ConfigError, match=r"--lora-targets='q,x'.*\(x is not one\)"):
        parse_lora_targets("q,x")
    with pytest.raises(ConfigError, match="distinct"):
        parse_lora_targets("q,q")
    assert parse_lora_targets(" q , ffn ") == ("q", "ffn")
    rnn = build_model(preset("tiny", arch="rnn-bahdanau", src_vocab_size=VOCAB,
                             tgt_vocab_size=VOCAB))
    with pytest.raises(ConfigError, match="no linear layer that --lora-targets"):
        add_adapters(rnn, LoRASettings(rank=2, alpha=2.0))
    with pytest.raises(ConfigError, match="lora_rank=0"):
        add_adapters(rnn, LoRASettings(rank=0, alpha=2.0))


def quantized_pair(format, dropout=0.0):
    """A layer whose frozen weight is kept in `format` and the float64 layer whose weight
    is that weight dequantized, with the same adapters (B drawn)."""
    torch.manual_seed(0)
    base = nn.Linear(64, 48).double()
    settings = LoRASettings(rank=4, alpha=8.0, dropout=dropout)
    layer = LoRALinear(copy.deepcopy(base), settings)
    layer.keep_frozen_in(format)
    base.weight.data = layer.quantized.dequantized(torch.float64)
    reference = LoRALinear(base, settings)
    with torch.no_grad():
        layer.lora_b.normal_()
        reference.lora_a.copy_(layer.lora_a)
        reference.lora_b.copy_(layer.lora_b)
    return layer, reference


@pytest.mark.parametrize("format", ["int8", "nf4", "nf4-dq"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_quantized_frozen_weight_computes_as_its_dequantized_matrix(format, dropout):
    """keep_frozen_in("int8" | "nf4"): in float64, the output and every gradient are the
    float layer's whose weight is the dequantized one, with dropout (two products) or
    without (one); and no weight-sized tensor waits for the backward pass (autograd's
    F.linear would keep every layer's dequantized weight until then)."""
    layer, reference = quantized_pair(format, dropout)
    assert layer.weight is None and layer.frozen_format == format
    assert set(layer.state_dict()) == {"bias", "lora_a", "lora_b"}
    inputs = torch.randn(2, 5, 64, dtype=torch.float64)
    results, saved = [], []
    for module in (layer, reference):
        x = inputs.clone().requires_grad_()
        torch.manual_seed(7)                         # the same dropout mask
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append((module is layer, t.numel())) or t, lambda t: t):
            out = module(x)
        out.square().sum().backward()
        results.append((out, x.grad, module.lora_a.grad, module.lora_b.grad))
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    assert max(numel for ours, numel in saved if ours) < 48 * 64
    merged = layer.merged_weight()
    torch.testing.assert_close(merged, reference.merged_weight(), rtol=1e-12, atol=1e-12)
    original = torch.randn(48, 64, dtype=torch.float64)     # merged into the original
    torch.testing.assert_close(layer.merged_weight(original),
                               original + 2.0 * layer.lora_b @ layer.lora_a)


@pytest.mark.parametrize("format", ["bfloat16", "int8", "nf4", "nf4-dq"])
def test_a_model_with_frozen_weights_kept_small_merges_to_its_state_dict(format):
    """merged_weights() names every weight the plain model has (a quantized one is not in
    the model's state dict: it is added), each merged into the weight as kept; so does
    the decoding copy, which computes as the adapted model does."""
    torch.manual_seed(1)
    model = build_model(preset("llama-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                               dropout=0.0)).eval()
    plain = copy.deepcopy(model)
    add_adapters(model, LoRASettings(rank=4, alpha=8.0))
    randomized(model)
    for layer in adapter_layers(model).values():
        layer.keep_frozen_in(format)
    merged = merged_weights(model)
    assert merged.keys() == plain.state_dict().keys()
    for name, layer in adapter_layers(model).items():
        kept = layer.frozen_weight(torch.float32)
        expected = kept + layer.scale * layer.lora_b @ layer.lora_a
        torch.testing.assert_close(merged[f"{name}.weight"].float(), expected,
                                   rtol=0.01 if format == "bfloat16" else 1e-6, atol=1e-6)
    ids = torch.randint(4, VOCAB, (2, 6))
    adapted = model(ids)
    copied = decoding_copy(model, torch.float32, "cpu")
    # bfloat16: the merged weight is rounded to bfloat16 once more.
    tolerance = 0.05 if format == "bfloat16" else 1e-4
    torch.testing.assert_close(copied(ids), adapted, rtol=tolerance, atol=tolerance)
    assert not torch.allclose(plain(ids), adapted, rtol=0.1, atol=0.1)
