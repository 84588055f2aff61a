"""The int8 rows kernel (model/int8_rows.py): the integer arithmetic it promises, repeated
in PyTorch bit for bit; 8-bit rows within their rounding of a float64 Linear; rows
independent of their batch and of the threads; and the decoding copies that take it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transduce.model import Transformer
from transduce.model import int8 as int8_module
from transduce.model import int8_rows
from transduce.model.int8 import Int8Linear, int8_available, quantize_weight
from transduce.model.int8_rows import Int8RowsLinear
from transduce.model.int8_vnni import Int8VnniLinear
from transduce.model.packed import decoding_copy
from transduce.model.scripting import compiled
from transduce.runtime import cpu_flags
from tests.model.test_decoder_only import tiny as tiny_language_model
from tests.model.test_transformer import tiny

# The int8 Linear layers a decoding copy may hold.
INT8_LAYERS = (Int8Linear, Int8RowsLinear, Int8VnniLinear)
needs_kernel = pytest.mark.skipif(
    "avx2" not in cpu_flags() or not int8_rows.KERNEL.available(),
    reason="the int8 rows kernel needs an x86 CPU with AVX2 and a compiler")


def reference(x: torch.Tensor, linear: nn.Linear, relu: bool = False) -> torch.Tensor:
    """What the kernel computes, in PyTorch's IEEE float32 operations and exact int64
    sums. x (N, in) -> (N, out)."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    values = torch.round(x / scale).clamp(-127, 127).long()                      # (N, in)
    weights, weight_scale = quantize_weight(linear.weight)
    sums = values @ weights.long().T                                            # (N, out)
    out = sums.float() * (scale * weight_scale[None, :])
    if linear.bias is not None:
        out = out + linear.bias.detach()
    return out.relu() if relu else out


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("inputs,outputs", [(1, 1), (31, 3), (32, 4), (33, 5), (100, 7),
                                            (256, 4096)])
@pytest.mark.parametrize("bias,relu", [(True, False), (False, False), (True, True)])
def test_the_kernel_is_its_integer_arithmetic_bit_for_bit(rows, inputs, outputs, bias, relu):
    """Widths that do not fill a register (31, 33, 100) or a tile of four channels, and
    row counts that leave a tile of two rows half full."""
    torch.manual_seed(rows * 1000 + inputs)
    linear = nn.Linear(inputs, outputs, bias=bias)
    x = torch.randn(rows, inputs) * torch.logspace(-3, 2, rows)[:, None]
    x[0, 0] = 0.0
    layer = Int8RowsLinear(linear, "relu" if relu else "none")
    with torch.no_grad():
        assert torch.equal(layer(x), reference(x, linear, relu))


def test_weights_are_interleaved_in_blocks_of_four_channels_by_32_columns():
    values = torch.arange(6 * 40).remainder(251).sub(125).to(torch.int8).view(6, 40)
    laid = int8_rows.interleave(values)
    assert laid.shape == (8, 64) and laid.is_contiguous()
    flat = laid.flatten()
    for channel in range(8):
        for column in range(64):
            block, step, offset = channel // 4, column // 32, column % 32
            got = flat[block * 4 * 64 + step * 4 * 32 + channel % 4 * 32 + offset]
            expected = values[channel, column] if channel < 6 and column < 40 else 0
            assert int(got) == int(expected)


@needs_kernel
def test_a_row_of_zeros_gives_the_bias_and_ties_round_to_even():
    linear = nn.Linear(64, 8)
    layer = Int8RowsLinear(linear)
    x = torch.zeros(3, 64)
    x[1, :2] = torch.tensor([2.5, 127.0])     # 2.5 steps: rounds to 2, as torch.round does
    x[2] = -1e-30                             # subnormal scales stay finite
    with torch.no_grad():
        got = layer(x)
        assert torch.equal(got[0], linear.bias.detach())
        assert torch.equal(got, reference(x, linear))
    assert got.isfinite().all()


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (3, 1, 256), (2, 130, 256)])
def test_eight_bit_rows_are_a_linear_within_their_rounding(bias, shape):
    """8 bits on both sides: under 1.2% of a product's size on random rows, where the 7
    bits of oneDNN's rows on a CPU without VNNI give about 1.5%."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        expected = F.linear(x.double(), linear.weight.double(),
                            None if linear.bias is None else linear.bias.double())
        got = Int8RowsLinear(linear)(x)
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 512)
    error = float((got.double() - expected).norm() / expected.norm())
    assert error < 0.012


def assert_rows_alone_as_in_any_batch_with_any_threads(layer: nn.Module, sizes: tuple):
    """layer (300 -> any): 41 rows of magnitudes 0.01 to 10, each run of `sizes` rows at
    the start, the middle and the end gives the bits of the whole batch's, and so does
    the batch on one thread."""
    x = torch.randn(41, 300) * torch.linspace(0.01, 10, 41)[:, None]
    threads = torch.get_num_threads()
    with torch.no_grad():
        batched = layer(x)
        for size in sizes:
            for start in (0, 5, 41 - size):
                assert torch.equal(layer(x[start:start + size]), batched[start:start + size])
        try:
            torch.set_num_threads(1)
            assert torch.equal(layer(x), batched)
        finally:
            torch.set_num_threads(threads)


@needs_kernel
def test_a_row_gets_the_same_result_alone_as_in_any_batch_with_any_threads():
    assert_rows_alone_as_in_any_batch_with_any_threads(Int8RowsLinear(nn.Linear(300, 301)),
                                                       sizes=(1, 2, 3, 17))


@needs_kernel
def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="activation 'gelu'"):
        Int8RowsLinear(nn.Linear(4, 4), "gelu")
    layer = Int8RowsLinear(nn.Linear(40, 8))
    op = torch.ops.transduce.int8_rows_linear
    with pytest.raises(RuntimeError, match="padded to a multiple of 32"):
        op(torch.randn(2, 70), layer.weight_values, layer.weight_scale, layer.bias, False)
    with pytest.raises(RuntimeError, match="float32, contiguous"):
        op(torch.randn(40, 2).T, layer.weight_values, layer.weight_scale, layer.bias, False)
    with pytest.raises(RuntimeError, match="weight_scale"):
        op(torch.randn(2, 40), layer.weight_values, layer.weight_scale[:2], None, False)


def test_without_the_kernel_the_layer_is_refused_and_never_preferred(monkeypatch):
    monkeypatch.setattr(int8_rows.KERNEL, "loaded", False)
    assert not int8_rows.preferred()
    with pytest.raises(RuntimeError, match="not built here"):
        Int8RowsLinear(nn.Linear(4, 4))
    monkeypatch.setattr(int8_rows.KERNEL, "loaded", None)
    monkeypatch.setenv(int8_rows.SWITCH, "0")
    assert not int8_rows.KERNEL.available()


@pytest.mark.parametrize("flags,preferred", [({"avx2", "fma"}, True),
                                             ({"avx2", "avx512_vnni"}, False),
                                             ({"avx2", "avx_vnni"}, False),
                                             ({"amx_int8", "avx2"}, False),
                                             ({"sse4_2"}, False), (set(), False)])
def test_preferred_on_avx2_without_vnni(monkeypatch, flags, preferred):
    monkeypatch.setattr("transduce.runtime.cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(int8_rows.KERNEL, "loaded", True)
    assert int8_rows.preferred() == preferred


@pytest.mark.skipif(not int8_available(), reason="no oneDNN int8 ops in this build")
@pytest.mark.parametrize("preferred", [True, False])
def test_a_language_models_int8_copy_takes_the_rows_kernel_where_preferred(monkeypatch,
                                                                          preferred):
    """Translation models keep oneDNN's kernel (or, with VNNI, the VNNI kernel's, which
    gives its bits): their products take hundreds of rows."""
    if preferred and not int8_rows.KERNEL.available():
        pytest.skip("the int8 rows kernel could not be built here")
    monkeypatch.setattr(int8_rows, "preferred", lambda: preferred)
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    def onednns(kinds):   # oneDNN's kernel, or the VNNI kernel with its bits
        return bool(kinds & {Int8Linear, Int8VnniLinear})

    kinds = {type(m) for m in decoding_copy(tiny_language_model().eval(), torch.int8).modules()}
    assert (Int8RowsLinear in kinds) == preferred and onednns(kinds) != preferred
    translation = {type(m) for m in decoding_copy(Transformer(tiny()).eval(),
                                                  torch.int8).modules()}
    assert onednns(translation) and Int8RowsLinear not in translation


@needs_kernel
def test_the_layer_compiles_with_torchscript_to_the_same_results():
    layer = Int8RowsLinear(nn.Linear(64, 40), "relu")
    scripted = compiled(layer)
    assert isinstance(scripted, torch.jit.ScriptModule)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        assert torch.equal(scripted(x), layer(x))
