"""Frozen weights in 8 and 4 bits (model/quantized_weight.py): the formats against
bitsandbytes' quantizers, code for code, and against the NF4 levels QLoRA publishes;
the dequantized weights' error bounds; dtypes and devices."""

import warnings

import pytest
import torch

from transduce.model.quantized_weight import (NF4_BLOCK, QuantizedWeight, nf4_levels,
                                              quantize_nf4)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")           # its notes on the CUDA it does not find
    from bitsandbytes import functional as bnb

# The levels as the QLoRA paper's appendix prints them (Dettmers et al. 2023).
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]
SHAPES = [(1, 1), (3, 64), (300, 77), (48, 128), (7, 5)]


def weight(shape, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(shape) * 0.02
    w.view(-1)[0] = 0.3          # an outlier: its block's other values get coarser steps
    return w


def test_the_nf4_levels_are_qloras():
    torch.testing.assert_close(nf4_levels(), torch.tensor(PUBLISHED_NF4), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_is_bitsandbytes_code_for_code(shape):
    """Blocks of 64 over the weight read row by row, the first of two codes in a byte's
    high half, each block scaled by its largest magnitude: bitsandbytes' layout, so the
    same bytes (ours padded to whole blocks) and the same dequantized weight."""
    w = weight(shape)
    packed, state = bnb.quantize_4bit(w, blocksize=NF4_BLOCK, quant_type="nf4")
    codes, scales = quantize_nf4(w)
    assert codes.dtype == torch.uint8 and codes.numel() == scales.numel() * NF4_BLOCK // 2
    assert torch.equal(codes[:packed.numel()], packed.view(-1))
    assert torch.equal(scales, state.absmax)
    ours = QuantizedWeight(w, "nf4").dequantized(torch.float32)
    torch.testing.assert_close(ours, bnb.dequantize_4bit(packed, state), rtol=0, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_is_bitsandbytes_row_wise_quantization(shape):
    w = weight(shape)
    values, row_maxima, _ = bnb.int8_vectorwise_quant(w)
    quantized = QuantizedWeight(w, "int8")
    assert torch.equal(quantized.codes, values)
    torch.testing.assert_close(quantized.scales, row_maxima / 127, rtol=1e-7, atol=0)


@pytest.mark.parametrize("format", ["int8", "nf4"])
def test_the_error_stays_within_half_a_step(format):
    """Each value lands on its nearest level: int8 within half its row's step, NF4 within
    half the widest gap between levels times its block's scale (an error past that would
    be a wrong code, a wrong scale or a misplaced block)."""
    w = weight((96, 200), seed=1)
    quantized = QuantizedWeight(w, format)
    error = (quantized.dequantized(torch.float32) - w).abs()
    if format == "int8":
        assert (error <= quantized.scales[:, None] / 2 * (1 + 1e-6)).all()
    else:
        levels = nf4_levels()
        half_gap = (levels[1:] - levels[:-1]).max() / 2
        scales = quantized.scales.repeat_interleave(NF4_BLOCK)[:w.numel()].view(w.shape)
        assert (error <= half_gap * scales * (1 + 1e-6)).all()
        numbers = torch.cat([quantized.codes >> 4, quantized.codes & 15])
        assert numbers.unique().numel() == 16        # every level in use
    # The largest magnitude of each row (block) comes back.
    torch.testing.assert_close(quantized.dequantized(torch.float32).view(-1)[0],
                               w.view(-1)[0], rtol=1e-6, atol=0)
    assert quantized.nbytes() / w.numel() <= {"int8": 1.03, "nf4": 0.5625}[format]


@pytest.mark.parametrize("format", ["int8", "nf4"])
def test_dtypes_devices_and_the_state_dict(format):
    """The weight in bfloat16 is the float32 one rounded once; model.to(bfloat16) casts
    the scales and never the codes; nothing of it enters a state dict."""
    w = weight((32, 64))
    quantized = QuantizedWeight(w, format)
    wide = quantized.dequantized(torch.float32)
    assert torch.equal(quantized.dequantized(torch.bfloat16), wide.to(torch.bfloat16))
    assert quantized.state_dict() == {} and quantized.dtype == torch.float32
    codes = quantized.codes.clone()
    quantized.to(torch.bfloat16)
    assert quantized.dtype == torch.bfloat16 and torch.equal(quantized.codes, codes)
    assert quantized.dequantized(torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="format 'int4': one of int8, nf4"):
        QuantizedWeight(w, "int4")
