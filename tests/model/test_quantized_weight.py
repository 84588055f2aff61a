"""Frozen weights in 8 and 4 bits (model/quantized_weight.py): the formats against
bitsandbytes' quantizers, code for code (NF4's scales in 8 bits too: QLoRA's double
quantization), and against the NF4 levels QLoRA publishes; the dequantized weights' error
bounds; dtypes and devices."""

import warnings

import pytest
import torch

from transduce.model.quantized_weight import (NF4_BLOCK, SCALE_BLOCK, QuantizedWeight,
                                              dynamic_levels, nf4_levels, quantize_nf4)

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


def test_the_dynamic_levels_are_bitsandbytes():
    assert torch.equal(dynamic_levels(), bnb.create_dynamic_map(signed=True))


@pytest.mark.parametrize("shape", [(3, 64), (300, 77), (48, 128), (640, 120)])  # 3-1,200 scales
def test_nf4_dq_is_bitsandbytes_double_quantization(shape):
    """compress_statistics=True: the same 4-bit codes, the scales less their mean in
    blocks of 256, the same scale of each block of scales, the same mean; each scale's
    byte the nearest level (bitsandbytes' native CPU search lands on a neighbouring one
    for about 0.2% of them, where its PyTorch kernel takes the nearest), and our bytes
    dequantized by bitsandbytes give our weight."""
    w = weight(shape)
    packed, state = bnb.quantize_4bit(w, blocksize=NF4_BLOCK, quant_type="nf4",
                                      compress_statistics=True)
    quantized = QuantizedWeight(w, "nf4-dq")
    assert torch.equal(quantized.codes[:packed.numel()], packed.view(-1))
    assert torch.equal(quantized.scale_largest, state.state2.absmax)
    assert torch.equal(quantized.scale_mean, state.offset)
    scales = quantize_nf4(w)[1]
    centred = (scales - scales.mean()) / \
        quantized.scale_largest.repeat_interleave(SCALE_BLOCK)[:scales.numel()]
    distances = (dynamic_levels()[None, :] - centred[:, None]).abs()          # (scales, 256)
    chosen = distances.gather(1, quantized.scale_codes.long()[:, None])[:, 0]
    assert (chosen <= distances.min(dim=1).values * (1 + 1e-6) + 1e-9).all()
    assert (quantized.scale_codes != state.absmax).float().mean() < 0.01
    state.absmax = quantized.scale_codes
    torch.testing.assert_close(quantized.dequantized(torch.float32),
                               bnb.dequantize_4bit(packed, state), rtol=0, atol=1e-7)
    # A byte a scale, 4 bytes a block of scales and 4 for the mean, beside the codes.
    blocks = -(-scales.numel() // SCALE_BLOCK)
    assert quantized.nbytes() == quantized.codes.numel() + scales.numel() + 4 * blocks + 4


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


@pytest.mark.parametrize("shape", [(1, 1), (7, 5)])
def test_one_scale_is_its_own_mean(shape):
    """A weight of one block has one scale, which is the mean: it comes back exactly."""
    w = weight(shape)
    doubled = QuantizedWeight(w, "nf4-dq")
    assert torch.equal(doubled.block_scales(torch.float32), quantize_nf4(w)[1])
    assert torch.equal(doubled.dequantized(torch.float32),
                       QuantizedWeight(w, "nf4").dequantized(torch.float32))


def test_double_quantization_moves_each_scale_within_half_a_step():
    """A scale of nf4-dq lands on the nearest level of its block's: within half the
    widest gap between dynamic levels times the block's largest deviation from the mean;
    the 4-bit codes stay NF4's, so a weight moves by no more than its scale does."""
    w = torch.randn(640, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    plain, doubled = QuantizedWeight(w, "nf4"), QuantizedWeight(w, "nf4-dq")
    assert torch.equal(plain.codes, doubled.codes)
    levels = dynamic_levels()
    half_gap = (levels[1:] - levels[:-1]).max() / 2
    largest = doubled.scale_largest.repeat_interleave(SCALE_BLOCK)[:plain.scales.numel()]
    moved = (doubled.block_scales(torch.float32) - plain.scales).abs()
    assert (moved <= half_gap * largest * (1 + 1e-6) + 1e-9).all()
    assert 0 < moved.max() < 0.01 * plain.scales.max()
    weights_moved = (doubled.dequantized(torch.float32) - plain.dequantized(torch.float32)).abs()
    assert (weights_moved.view(-1, NF4_BLOCK) <= moved[:, None] * (1 + 1e-6)).all()
    assert doubled.nbytes() / w.numel() < 0.517 < plain.nbytes() / w.numel()


@pytest.mark.parametrize("format", ["int8", "nf4", "nf4-dq"])
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
