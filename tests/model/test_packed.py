"""The copies used for decoding: packed Linear layers against F.linear in float32 and
bfloat16, and the original model left untouched."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transduce.model import Transformer
from transduce.model import packed as packed_module
from transduce.model.packed import PackedLinear, bfloat16_copy, decoding_copy, packing_available
from tests.model.test_transformer import tiny

needs_packing = pytest.mark.skipif(not packing_available(),
                                   reason="no oneDNN bfloat16 support on this CPU")


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("shape", [(128, 48), (3, 1, 48), (1, 48), (2, 5, 48)])
def test_packed_linear_equals_a_bfloat16_linear(bias, activation, shape):
    linear = nn.Linear(48, 72, bias=bias)
    x = torch.randn(shape).bfloat16()
    expected = F.linear(x.double(), linear.weight.bfloat16().double(),
                        None if linear.bias is None else linear.bias.bfloat16().double())
    if activation == "relu":
        expected = expected.relu()
    got = PackedLinear(linear.bfloat16(), activation)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], 72)
    # Products of bfloat16 inputs, accumulated in float32, rounded once to bfloat16.
    torch.testing.assert_close(got.double(), expected, rtol=8e-3, atol=1e-2)


def test_bfloat16_copy_leaves_the_model_alone():
    model = Transformer(tiny()).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    clone = bfloat16_copy(model)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in clone.parameters())
    if packing_available():
        assert not any(type(m) is nn.Linear for m in clone.modules())
        assert not any(key.endswith("packed_weight") for key in clone.state_dict())
        ffn = clone.decoder.layers[0].ffn
        assert ffn.linear1.activation == "relu" and type(ffn.activation) is nn.Identity


@pytest.mark.skipif(not packing_available(torch.float32), reason="no oneDNN in this build")
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("shape", [(1, 48), (8, 48), (3, 1, 48), (130, 48)])
def test_float32_packed_linear_is_as_exact_as_f_linear(activation, shape):
    linear = nn.Linear(48, 72)
    x = torch.randn(shape)
    expected = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    if activation == "relu":
        expected = expected.relu()
    got = PackedLinear(linear, activation)(x)
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 72)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_float32_decoding_copy_gives_the_models_logits(packed, monkeypatch):
    """Fused self-attention projections, packed or (forced) plain Linear layers."""
    if packed and not packing_available(torch.float32):
        pytest.skip("no oneDNN in this build")
    monkeypatch.setattr(packed_module, "packing_available", lambda dtype=None: packed)
    model = Transformer(tiny()).eval()
    clone = decoding_copy(model, torch.float32)
    assert clone.output_proj is not model.output_proj
    assert any(type(m) is nn.Linear for m in clone.modules()) is not packed
    for layer in [*clone.encoder.layers, *clone.decoder.layers]:
        assert layer.self_attn.q_proj is None and layer.self_attn.qkv_proj is not None
    assert all(layer.cross_attn.q_proj is not None for layer in clone.decoder.layers)
    src, tgt = torch.randint(4, 20, (3, 7)), torch.randint(4, 20, (3, 5))
    with torch.no_grad():
        torch.testing.assert_close(clone(src, tgt), model(src, tgt), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_decoding_copy_counts_its_sources_parameters(dtype):
    """Packed and int8 weights are buffers; the copy still reports the model's size."""
    from transduce.model.int8 import int8_available

    if dtype == torch.int8 and not int8_available():
        pytest.skip("no oneDNN int8 ops in this build")
    model = Transformer(tiny())
    clone = decoding_copy(model, dtype)
    assert clone.num_parameters() == model.num_parameters()
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_each_replaced_layer_is_freed_before_the_next_is_converted(dtype, monkeypatch):
    """The conversion needs one layer's memory more, not the model's: nothing it keeps
    holds a Linear layer it has replaced (a 3.3B model's packing peaked at +9.5 GiB so)."""
    import gc
    import weakref

    from transduce.model.int8 import Int8Linear, int8_available
    from transduce.model.int8_vnni import Int8VnniLinear

    if dtype == torch.int8 and not int8_available():
        pytest.skip("no oneDNN int8 ops in this build")
    if dtype == torch.float32 and not packing_available(torch.float32):
        pytest.skip("no oneDNN in this build")
    model = Transformer(tiny()).eval()
    converted, still_alive = [], []
    for kind in (PackedLinear, Int8Linear, Int8VnniLinear):
        def counting(self, linear, *args, original=kind.__init__, **kwargs):
            gc.collect(0)           # the young objects: a full collection takes 0.7 s here
            still_alive.extend(ref for ref in converted if ref() is not None)
            converted.append(weakref.ref(linear))
            original(self, linear, *args, **kwargs)
        monkeypatch.setattr(kind, "__init__", counting)
    assert decoding_copy(model, dtype, in_place=True) is model
    assert len(converted) == 25 and not still_alive     # every Linear, the fused ones too
