"""Int8 products (model/int8.py): against a float64 Linear within int8's rounding, rows
independent of their batch, and the int8 decoding copy against the float model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transduce.model import Transformer
from transduce.model import int8 as int8_module
from transduce.model import packed as packed_module
from transduce.model.int8 import Int8Linear, int8_available, quantize_rows, quantize_weight, \
    worth_int8
from transduce.model.int8_vnni import Int8VnniLinear
from transduce.model.packed import PackedLinear, decoding_copy, packing_available
from tests.model.test_transformer import tiny

needs_int8 = pytest.mark.skipif(not int8_available(), reason="no oneDNN int8 ops in this build")


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).norm() / expected.norm())


def test_weights_are_quantized_per_output_channel_within_half_a_step():
    weight = torch.randn(24, 40) * torch.logspace(-3, 1, 24)[:, None]   # channels far apart
    values, scales = quantize_weight(weight)
    assert values.dtype == torch.int8 and scales.shape == (24,)
    assert int(values.abs().max()) == 127 and int(values.min()) >= -127
    error = (values.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("levels,zero_point", [(127, 128), (63, 64)])
def test_rows_are_quantized_each_by_its_own_largest_magnitude(levels, zero_point):
    x = torch.randn(5, 33) * torch.tensor([1e-4, 1.0, 30.0, 1.0, 1.0])[:, None]
    x[3] = 0.0                                                          # a zero row
    values, scale = quantize_rows(x, levels, zero_point)
    assert values.dtype == torch.uint8 and scale.shape == (5, 1)
    assert int(values.min()) >= zero_point - levels and int(values.max()) <= zero_point + levels
    restored = (values.float() - zero_point) * scale
    assert bool(((restored - x).abs() <= scale / 2 * (1 + 1e-5)).all())
    assert torch.equal(values[3], torch.full((33,), zero_point, dtype=torch.uint8))
    assert not restored.isnan().any()


@pytest.mark.parametrize("flags,expected", [({"avx2", "avx512_vnni"}, (127, 128)),
                                            ({"avx2", "avx_vnni"}, (127, 128)),
                                            ({"amx_int8", "amx_bf16"}, (127, 128)),
                                            ({"avx2", "fma"}, (63, 64)),
                                            ({"avx512f", "avx512bw"}, (63, 64)),
                                            (set(), (63, 64))])
def test_activations_take_8_bits_only_where_vnni_sums_in_int32(monkeypatch, flags, expected):
    monkeypatch.setattr("transduce.runtime.cpu_flags", lambda: frozenset(flags))
    assert int8_module.activation_range() == expected


@needs_int8
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_int8_product_is_the_exact_integer_product_on_this_cpu(rows):
    """No pair of u8 x s8 products saturates: the product, unscaled, is the integers'
    sum of products (exact in float32 up to 2^24), whatever this CPU's instructions."""
    torch.manual_seed(rows)
    linear = nn.Linear(256, 40, bias=False)
    int8 = Int8Linear(linear)
    x = torch.randn(rows, 256) * 4
    values, scale = quantize_rows(x, int8.levels, int8.zero_point)
    weights, weight_scales = quantize_weight(linear.weight)
    exact = (values.long() - int8.zero_point) @ weights.long().T                # (N, 40)
    got = int8(x) / scale / weight_scales
    assert torch.equal(got.round().long(), exact)
    assert (got - exact).abs().max() < 1e-2 * exact.abs().max()


@needs_int8
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 1, 64), (2, 130, 64)])
def test_int8_linear_is_a_linear_within_int8_rounding(bias, activation, shape):
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x.double(), linear.weight.double(),
                        None if linear.bias is None else linear.bias.double())
    if activation == "relu":
        expected = expected.relu()
    got = Int8Linear(linear, activation)(x)
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 96)
    # 8 bits on each side (7 for activations without VNNI): about 1% of a product's size;
    # a wrong scale, or saturated sums, far off.
    assert _relative_error(got, expected) < 0.02
    if activation == "relu":
        assert bool((got >= 0).all())


@needs_int8
def test_a_row_gets_the_same_result_alone_as_in_any_batch():
    linear = Int8Linear(nn.Linear(256, 300))
    x = torch.randn(40, 256) * torch.linspace(0.01, 10, 40)[:, None]
    batched = linear(x)
    for size in (1, 3, 17):
        for start in (0, 5, 40 - size):
            assert torch.equal(linear(x[start:start + size]), batched[start:start + size])


@needs_int8
def test_int8_linear_refuses_other_activations():
    with pytest.raises(ValueError, match="activation 'gelu'"):
        Int8Linear(nn.Linear(4, 4), "gelu")


def test_products_of_d_model_256_and_up_are_worth_int8():
    assert worth_int8(nn.Linear(256, 8000, bias=False))
    assert worth_int8(nn.Linear(256, 1024)) and worth_int8(nn.Linear(1024, 256))
    assert worth_int8(nn.Linear(256, 256))
    assert not worth_int8(nn.Linear(128, 128))
    assert not worth_int8(nn.Linear(64, 256))


@needs_int8
@pytest.mark.parametrize("packed", [True, False])
def test_the_int8_decoding_copy_stays_near_the_models_logits(packed, monkeypatch):
    """Every Linear forced to int8 (the tiny model has no wide one), the others packed or
    (forced) plain; the model itself is left as it was."""
    if packed and not packing_available(torch.float32):
        pytest.skip("no oneDNN in this build")
    monkeypatch.setattr(packed_module, "packing_available", lambda dtype=None: packed)
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    model = Transformer(tiny()).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    clone = decoding_copy(model, torch.int8)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(type(m) is not nn.Linear for m in clone.modules())
    assert all(p.dtype == torch.float32 for p in clone.parameters())
    ffn = clone.decoder.layers[0].ffn
    assert isinstance(ffn.linear1, (Int8Linear, Int8VnniLinear)) and \
        ffn.linear1.activation == "relu"
    src, tgt = torch.randint(4, 20, (3, 7)), torch.randint(4, 20, (3, 5))
    with torch.no_grad():
        expected = model.double()(src, tgt)
        got = clone(src, tgt)
    assert _relative_error(got, expected) < 0.05
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@needs_int8
def test_the_int8_copy_keeps_narrow_products_in_float32():
    model = Transformer(tiny()).eval()
    clone = decoding_copy(model, torch.int8)
    kinds = {type(m) for m in clone.modules()}
    assert not kinds & {Int8Linear, Int8VnniLinear}   # the tiny model's products are all narrow
    if packing_available(torch.float32):
        assert PackedLinear in kinds and nn.Linear not in kinds


def test_int8_decoding_needs_a_cpu_and_the_int8_ops(monkeypatch):
    model = Transformer(tiny()).eval()
    with pytest.raises(ValueError, match="int8 decoding runs on a CPU"):
        decoding_copy(model, torch.int8, device="meta")
    monkeypatch.setattr(packed_module, "int8_available", lambda: False)
    with pytest.raises(ValueError, match="ops available: False"):
        decoding_copy(model, torch.int8)
