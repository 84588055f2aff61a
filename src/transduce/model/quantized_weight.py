"""Frozen weights kept in fewer bits, for LoRA on a base that would not fit in memory
otherwise (QLoRA, Dettmers et al. 2023): the adapters train in full precision beside a
weight stored in 8 or 4 bits and dequantized, one layer at a time, only for the product
that reads it.

- "int8": one int8 value per weight and one scale per output channel (the symmetric
  per-channel scheme of int8 decoding, model/int8.py): 1.0 byte a weight, 1/4 of float32.
- "nf4": QLoRA's 4-bit NormalFloat. Weights are cut into blocks of 64 (the matrix read
  row by row), each divided by its largest magnitude, and each value rounded to the
  nearest of 16 levels placed at quantiles of the standard normal distribution, which a
  trained layer's weights roughly follow: 0.5 byte a weight and 4 bytes a block's scale,
  0.5625 bytes in all, 14% of float32.
- "nf4-dq": NF4 with QLoRA's "double quantization" of the scales. The codes are NF4's;
  the block scales, less their mean, are cut into blocks of 256, each divided by its
  largest magnitude and rounded to the nearest of 256 levels of the 8-bit dynamic type
  (Dettmers 2016: a sign, a power of ten, then a fraction on a linear grid that is finer
  the larger the power; `dynamic_levels`): a byte a scale, and 4 bytes per 256 scales and
  for the mean. 0.516 bytes a weight in all, 12.9% of float32.

Dequantizing costs a few elementwise passes over the weight, each time a product reads
it, forward and backward: no copy of it outlives the product.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transduce.model.int8 import quantize_weight

FORMATS = ("int8", "nf4", "nf4-dq")
NF4_BLOCK = 64
SCALE_BLOCK = 256      # nf4-dq's blocks of scales


def nf4_levels() -> Tensor:
    """The 16 NF4 levels (float32, ascending, -1 to 1 with an exact 0), built as QLoRA
    builds them: 8 positive levels at quantiles of N(0, 1) from 1/2 up to a top quantile
    q, 7 negative from 1/2 down to 1 - q, each side scaled to end at magnitude 1. The top
    quantile q is the mean of 1 - 1/(2 * 15) and 1 - 1/(2 * 16), the ends of a 15- and a
    16-level grid, so that the last level is finite."""
    top = ((1 - 1 / 30) + (1 - 1 / 32)) / 2
    positive = torch.special.ndtri(torch.linspace(top, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(top, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).sort().values
    return (levels / levels.abs().max()).float()


def quantize_nf4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight (out, in) -> codes (ceil(out * in / 64) * 32,) uint8, two 4-bit level numbers
    a byte (the first in the high half), and scales (blocks,) float32, each block's
    largest magnitude; the last block is padded with zeros."""
    flat = weight.detach().float().reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % NF4_BLOCK)])
    blocks = flat.view(-1, NF4_BLOCK)                                      # (blocks, 64)
    scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    levels = nf4_levels()
    midpoints = (levels[1:] + levels[:-1]) / 2
    numbers = torch.bucketize(blocks / scales[:, None], midpoints).to(torch.uint8).view(-1, 2)
    return (numbers[:, 0] << 4) | numbers[:, 1], scales


def dynamic_levels() -> Tensor:
    """The 256 levels of the signed 8-bit dynamic type (float32, ascending, -1 to 1): for
    each exponent e of 0 to 6, the 2^e midpoints of an even grid of 2^e + 1 points from
    0.1 to 1, times 10^(e - 6), with both signs; and 0 and 1. The larger the power of
    ten, the finer its grid: 64 levels from 0.1 to 1, one from 1e-7 to 1e-6."""
    levels = [torch.zeros(1), torch.ones(1)]
    for exponent in range(7):
        grid = torch.linspace(0.1, 1, 2 ** exponent + 1)
        midpoints = (grid[:-1] + grid[1:]) / 2
        levels += [10.0 ** (exponent - 6) * midpoints, -(10.0 ** (exponent - 6)) * midpoints]
    return torch.cat(levels).sort().values


def quantize_scales(scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """NF4's block scales (blocks,) float32 -> their codes (blocks,) uint8, each block of
    256's largest magnitude (ceil(blocks / 256),) float32, and the mean subtracted first
    () float32: scale = dynamic_levels()[code] * largest + mean."""
    mean = scales.mean()
    centred = scales - mean
    padded = torch.cat([centred, centred.new_zeros(-centred.numel() % SCALE_BLOCK)])
    blocks = padded.view(-1, SCALE_BLOCK)
    largest = blocks.abs().amax(dim=1)           # 0 where every scale is the mean: code 0.0
    levels = dynamic_levels()
    normalized = blocks / largest.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    codes = torch.bucketize(normalized, (levels[1:] + levels[:-1]) / 2)
    return codes.view(-1)[:scales.numel()].to(torch.uint8), largest, mean


def _nf4_pairs(dtype: torch.dtype) -> Tensor:
    """(256, 2): the two levels each byte of codes stands for."""
    levels = nf4_levels().to(dtype)
    byte = torch.arange(256)
    return torch.stack([levels[byte >> 4], levels[byte & 15]], dim=1)


class QuantizedWeight(nn.Module):
    """A frozen (out, in) weight in `format` ("int8", "nf4" or "nf4-dq"). Its codes and
    scales are buffers left out of the state dict: a checkpoint holds weights in float,
    never these. The scales follow the module's dtype (model.to(bfloat16) casts them; for
    nf4-dq, the scales of its scales and their mean), the codes stay."""

    def __init__(self, weight: Tensor, format: str):
        super().__init__()
        if format not in FORMATS:
            raise ValueError(f"format {format!r}: one of {', '.join(FORMATS)}")
        self.format, self.shape = format, tuple(weight.shape)
        codes, scales = quantize_weight(weight) if format == "int8" else quantize_nf4(weight)
        self.register_buffer("codes", codes, persistent=False)
        if format == "nf4-dq":
            scale_codes, largest, mean = quantize_scales(scales)
            self.register_buffer("scale_codes", scale_codes, persistent=False)
            self.register_buffer("scale_largest", largest.to(weight.dtype), persistent=False)
            self.register_buffer("scale_mean", mean.to(weight.dtype), persistent=False)
            scales = None
        self.register_buffer("scales", None if scales is None else scales.to(weight.dtype),
                             persistent=False)
        # Plain attributes, not buffers: model.to(bfloat16) would round the levels.
        self.nf4_pairs = None if format == "int8" else _nf4_pairs(torch.float32)
        self.scale_levels = dynamic_levels() if format == "nf4-dq" else None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight was kept in before (its scales', unless cast since)."""
        return (self.scales if self.scales is not None else self.scale_largest).dtype

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def nbytes(self) -> int:
        """What the weight takes in memory: codes and scales (nf4-dq: and theirs)."""
        return sum(buffer.nbytes for buffer in self.buffers())

    def block_scales(self, dtype: torch.dtype) -> Tensor:
        """Each row's (int8) or block's (nf4) scale, (out,) or (blocks,), in `dtype`."""
        if self.scales is not None:
            return self.scales.to(dtype)
        levels = self.scale_levels.to(device=self.scale_codes.device, dtype=dtype)
        largest = self.scale_largest.to(dtype).repeat_interleave(SCALE_BLOCK)
        centred = levels[self.scale_codes.int()] * largest[:self.scale_codes.numel()]
        return centred + self.scale_mean.to(dtype)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The weight (out, in) in `dtype`, computed in float32 at least (then rounded once)."""
        wide = torch.promote_types(dtype, torch.float32)
        scales = self.block_scales(wide)
        if self.format == "int8":
            return self.codes.to(wide).mul_(scales[:, None]).to(dtype)
        pairs = self.nf4_pairs.to(device=self.codes.device, dtype=wide)
        blocks = pairs[self.codes.int()].view(-1, NF4_BLOCK).mul_(scales[:, None])
        return blocks.view(-1)[:self.numel()].view(self.shape).to(dtype)

    def extra_repr(self) -> str:
        return f"format={self.format}, shape={self.shape}"
