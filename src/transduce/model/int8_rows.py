"""Int8 products of a few rows on x86 CPUs without VNNI, in C++ (int8_rows.cpp): a
language model's decoding step, one row a prompt.

There oneDNN's int8 product (model/int8.py) gives the rows 7 bits and is slow at a few
rows: on a 2-core Zen 3 (AVX2, no VNNI) it ran 0.47-1.33x packed float32's speed at one
row, and generating in int8 ran 0.67-1.00x float32, so `--dtype auto` generated in
float32 there. This kernel quantizes the rows and multiplies in one call, two rows and
four output channels a tile, each weight register serving both rows, the four channels'
weights interleaved so that a tile reads them in one stream; each pair of u8 x
s8 products is summed in int16 without saturating (the rows' magnitudes times the
weights carrying the rows' signs), so the rows keep 8 bits. Per product, against packed
float32 on the same weights, interleaved (`python bench/int8_rows.py`, the shapes of a
768- and a 1,024-wide language model, Zen 3): 2.0-5.0x at one row (3.5-4.8x oneDNN's
int8), 1.1-3.1x at four to eight rows, 0.8-2.2x at 32 and 0.65-1.4x at 128 (0.48-0.79x
oneDNN's there); 0.8-0.95% off the float64 product where oneDNN's 7-bit rows are
1.5-1.8%. A language model generated 2.37-2.74x float32 at one prompt and 1.31-1.40x at
eight, from 5.3M to 160M parameters (bench/decode_dtypes.py), and a trained one scored
the test verses' perplexity 0.012% above float32's (oneDNN's 7 bits: 0.027%).

Every row is quantized by its own largest magnitude and its sums are exact, so a row's
result is the same alone as in any batch, as with oneDNN's kernel. The two kernels
quantize differently, so one model's products all take the same one: a language
model's decoding copy takes this one where `preferred()`, and translation and encoder
models, whose products take hundreds of rows at once, keep oneDNN's (at 128 rows this
kernel ran 0.48-0.79x its speed). Built on first use (transduce/native.py);
TRANSDUCE_INT8_ROWS_KERNEL=0 turns it off.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transduce.model.int8 import VNNI_FLAGS, Int8Layer, quantize_weight
from transduce.native import NativeKernel

SOURCE = Path(__file__).with_name("int8_rows.cpp")
SWITCH = "TRANSDUCE_INT8_ROWS_KERNEL"
# -fopenmp: ATen's parallel_for is inline and runs on one thread where it is compiled
# without OpenMP; with it, the kernel takes PyTorch's own OpenMP threads. Before, it ran
# on one thread whatever torch's count: at two threads it now takes 0.44-0.70x that
# time (every shape and row count of bench/int8_rows.py, on a Zen 5).
KERNEL = NativeKernel(SOURCE, "int8 rows", SWITCH,
                      "int8 products use oneDNN's kernel instead",
                      extra_cflags=("-ffp-contract=off", "-fopenmp"))
STEP = 32      # the kernel reads a weight row this many columns at a time
CHANNELS = 4   # and this many output channels together


def preferred() -> bool:
    """Whether a language model's int8 products take this kernel here: an x86 CPU with
    AVX2 and without VNNI (see above), where the kernel builds."""
    from transduce.runtime import cpu_flags

    flags = cpu_flags()
    return "avx2" in flags and not flags & VNNI_FLAGS and KERNEL.available()


def interleave(values: Tensor) -> Tensor:
    """int8 weights (N, K) -> (Np, Kp) as the kernel reads them: padded with zeros to a
    multiple of STEP columns and of CHANNELS rows, each block of CHANNELS rows interleaved
    by STEP columns, so that a block is one stream from memory."""
    padded = F.pad(values, (0, -values.shape[1] % STEP, 0, -values.shape[0] % CHANNELS))
    rows, columns = padded.shape
    blocks = padded.view(rows // CHANNELS, CHANNELS, columns // STEP, STEP)
    return blocks.transpose(1, 2).reshape(rows, columns)                  # (Np, Kp)


class Int8RowsLinear(Int8Layer):
    """A Linear with int8 weights (one scale per output channel) whose rows are quantized
    to 8 bits at every call, for CPU inference (Int8Layer). (..., in) -> (..., out),
    float32. The weight is held as the kernel reads it (interleave)."""

    def __init__(self, linear: nn.Linear, activation: str = "none"):
        if not KERNEL.available():
            raise RuntimeError("the int8 rows kernel is not built here: "
                               "int8_rows.KERNEL.available() is False")
        values, scales = quantize_weight(linear.weight)
        super().__init__(linear, activation, scales)
        self.register_buffer("weight_values", interleave(values), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()                # (N, in)
        out = torch.ops.transduce.int8_rows_linear(rows, self.weight_values, self.weight_scale,
                                                   self.bias, self.relu)  # (N, out)
        return out.view(list(x.shape[:-1]) + [self.out_features])
