"""The int8 VNNI kernel (model/int8_vnni.py): oneDNN's int8 product (model/int8.py) bit
for bit at every row count and shape, rows independent of their batch and of the
threads, its layout, its refusals, and the decoding copies that take it."""

import pytest
import torch
from torch import nn

from transduce.model import Transformer
from transduce.model import int8 as int8_module
from transduce.model import int8_rows, int8_vnni
from transduce.model.int8 import Int8Linear, int8_available, quantize_weight
from transduce.model.int8_vnni import Int8VnniLinear
from transduce.model.packed import decoding_copy
from transduce.model.scripting import compiled
from tests.model.test_decoder_only import tiny as tiny_language_model
from tests.model.test_int8_rows import assert_rows_alone_as_in_any_batch_with_any_threads
from tests.model.test_transformer import tiny

needs_kernel = pytest.mark.skipif(
    not int8_available() or not int8_vnni.available(),
    reason="the int8 VNNI kernel needs AVX512-VNNI, oneDNN's int8 ops and a compiler")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 33])
@pytest.mark.parametrize("inputs,outputs", [(1, 1), (3, 5), (16, 64), (37, 65), (100, 130),
                                            (256, 768), (1024, 256)])
@pytest.mark.parametrize("bias,activation", [(True, "none"), (False, "none"), (True, "relu"),
                                             (False, "relu")])
def test_the_kernel_gives_onednns_bits(rows, inputs, outputs, bias, activation):
    """Widths that fill no group of four columns (1, 3, 37), channels that fill no block
    of 64 (1, 5, 65, 130), row counts that leave a tile of six rows part full; rows of
    very different magnitudes. The bias path is addcmul's one rounding."""
    torch.manual_seed(rows * 1000 + inputs + outputs)
    linear = nn.Linear(inputs, outputs, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-2, 1, outputs)[:, None])
    x = torch.randn(rows, inputs) * torch.logspace(-3, 3, rows)[:, None]
    oneDNN, kernel = Int8Linear(linear, activation), Int8VnniLinear(linear, activation)
    with torch.no_grad():
        assert same_bits(kernel(x), oneDNN(x))


@needs_kernel
def test_inputs_of_any_rank_and_layout_keep_their_leading_shape():
    linear = nn.Linear(40, 70)
    oneDNN, kernel = Int8Linear(linear), Int8VnniLinear(linear)
    with torch.no_grad():
        for x in (torch.randn(40), torch.randn(3, 5, 40), torch.randn(40, 6).T,
                  torch.randn(2, 0, 40)):
            got = kernel(x)
            assert got.shape == (*x.shape[:-1], 70) and same_bits(got, oneDNN(x))


@needs_kernel
def test_zero_rows_ties_and_subnormal_rows_are_onednns():
    linear = nn.Linear(64, 70)
    x = torch.zeros(4, 64)
    x[1, :2] = torch.tensor([2.5, 127.0])     # 2.5 steps: a tie, rounded to even
    x[2] = -1e-30                             # a subnormal row's scale stays finite
    x[3, ::2] = 1e30
    oneDNN, kernel = Int8Linear(linear), Int8VnniLinear(linear)
    with torch.no_grad():
        got = kernel(x)
        assert torch.equal(got[0], linear.bias.detach())
        assert same_bits(got, oneDNN(x)) and got.isfinite().all()
        assert same_bits(kernel(torch.empty(0, 64)), torch.empty(0, 70))


@needs_kernel
def test_a_row_gets_the_same_result_alone_as_in_any_batch_with_any_threads():
    """Every part-full tile of six rows, alone and at each place in the batch."""
    assert_rows_alone_as_in_any_batch_with_any_threads(Int8VnniLinear(nn.Linear(300, 301)),
                                                       sizes=(1, 2, 3, 4, 5, 6, 7, 8))


def test_weights_are_laid_out_in_blocks_of_64_channels_four_columns_at_a_time():
    values = torch.arange(70 * 10).remainder(251).sub(125).to(torch.int8).view(70, 10)
    laid = int8_vnni.layout(values)
    assert laid.shape == (2, 3, 64, 4) and laid.is_contiguous()
    for channel in range(128):
        for column in range(12):
            got = laid[channel // 64, column // 4, channel % 64, column % 4]
            expected = values[channel, column] if channel < 70 and column < 10 else 0
            assert int(got) == int(expected)


@needs_kernel
def test_the_compensation_is_the_zero_points_share_of_the_sums():
    linear = nn.Linear(50, 7)
    layer = Int8VnniLinear(linear)
    values, _ = quantize_weight(linear.weight)
    assert layer.compensation.dtype == torch.int32
    assert torch.equal(layer.compensation.long(), values.long().sum(dim=1) * 128)


@needs_kernel
def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="activation 'gelu'"):
        Int8VnniLinear(nn.Linear(4, 4), "gelu")
    layer = Int8VnniLinear(nn.Linear(40, 130))          # three blocks of 64 channels
    op = torch.ops.transduce.int8_vnni_linear
    args = (layer.weight_values, layer.compensation, layer.weight_scale, layer.bias, False)
    with pytest.raises(RuntimeError, match="padded to a multiple of 4"):
        op(torch.randn(2, 44), *args)
    with pytest.raises(RuntimeError, match="float32 on the CPU"):
        op(torch.randn(2, 40, dtype=torch.float64), *args)
    with pytest.raises(RuntimeError, match="weight_scale"):
        op(torch.randn(2, 40), layer.weight_values, layer.compensation[:2],
           layer.weight_scale[:2], None, False)
    with pytest.raises(RuntimeError, match="compensation"):
        op(torch.randn(2, 40), layer.weight_values, layer.compensation[:2],
           layer.weight_scale, None, False)


def test_without_the_kernel_the_layer_is_refused(monkeypatch):
    monkeypatch.setattr(int8_vnni.KERNEL, "loaded", False)
    assert not int8_vnni.available()
    with pytest.raises(RuntimeError, match="does not run here"):
        Int8VnniLinear(nn.Linear(4, 4))
    monkeypatch.setattr(int8_vnni.KERNEL, "loaded", None)
    monkeypatch.setenv(int8_vnni.SWITCH, "0")
    assert not int8_vnni.KERNEL.available()


@pytest.mark.parametrize("flags,runs", [({"avx512f", "avx512bw", "avx512_vnni"}, True),
                                        ({"avx512f", "avx512bw"}, False),
                                        ({"avx2", "avx_vnni"}, False), (set(), False)])
def test_it_runs_only_with_avx512_vnni(monkeypatch, flags, runs):
    monkeypatch.setattr("transduce.runtime.cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(int8_vnni.KERNEL, "loaded", True)
    assert int8_vnni.available() == runs


@pytest.mark.skipif(not int8_available(), reason="no oneDNN int8 ops in this build")
@pytest.mark.parametrize("runs", [True, False])
def test_int8_copies_take_the_kernel_where_it_runs(monkeypatch, runs):
    """Translation models and language models alike; a language model on a CPU without
    VNNI takes the int8 rows kernel instead (model/int8_rows.py)."""
    if runs and not int8_vnni.available():
        pytest.skip("the int8 VNNI kernel does not run here")
    monkeypatch.setattr(int8_vnni, "available", lambda: runs)
    monkeypatch.setattr(int8_rows, "preferred", lambda: False)
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    for model in (Transformer(tiny()).eval(), tiny_language_model().eval()):
        kinds = {type(m) for m in decoding_copy(model, torch.int8).modules()}
        assert (Int8VnniLinear in kinds) == runs and (Int8Linear in kinds) != runs


@needs_kernel
def test_a_models_int8_copy_gives_the_same_bits_through_either_kernel(monkeypatch):
    """The whole model, every product in int8: its logits (the encoder's pass, the
    decoder's layers) equal oneDNN's copy's bit for bit."""
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    model = Transformer(tiny()).eval()
    kernel_copy = decoding_copy(model, torch.int8)
    monkeypatch.setattr(int8_vnni, "available", lambda: False)
    onednn_copy = decoding_copy(model, torch.int8)
    assert any(isinstance(m, Int8VnniLinear) for m in kernel_copy.modules())
    assert not any(isinstance(m, Int8VnniLinear) for m in onednn_copy.modules())
    src, tgt = torch.randint(4, 20, (3, 9)), torch.randint(4, 20, (3, 6))
    with torch.no_grad():
        assert same_bits(kernel_copy(src, tgt), onednn_copy(src, tgt))


@needs_kernel
def test_the_layer_compiles_with_torchscript_to_the_same_results():
    layer = Int8VnniLinear(nn.Linear(64, 40), "relu")
    scripted = compiled(layer)
    assert isinstance(scripted, torch.jit.ScriptModule)
    with torch.no_grad():
        for shape in ((3, 5, 64), (2, 1, 64), (1, 64)):
            x = torch.randn(shape)
            assert same_bits(scripted(x), layer(x))
