"""Int8 products on x86 CPUs with AVX512-VNNI, in C++ (int8_vnni.cpp), with the bits of
oneDNN's (model/int8.py) at a fraction of its time for a few rows.

oneDNN's int8 Linear costs a dozen PyTorch operators a call around its product (a row's
scale, the quantization, the rescaling), about 30 us whatever the product's size, and
a decoder step of one sentence is mostly such calls: each of the `small` translation
model's layer products took 39-61 us in int8 against 16-39 us packed float32 (one row,
one or two threads, a 2-core Zen 5). This kernel quantizes the rows, multiplies and
rescales in one call, a tile of six rows and 64 channels at a time: 5.7-8.0 us there
(6.3-7.9x oneDNN's), 2.7-4.0x oneDNN's speed for GPT-2's 768-wide products at one
row, and 1.15-3.9x at 128 and 512 rows (`python bench/int8_vnni.py`). Whole
translations of one sentence at a time ran 2.3x faster at beam 4 and 3.1x greedy, in
batches of 32 1.2-1.9x (bench/decode.py, "ours int8 oneDNN" against "ours int8").

The arithmetic is oneDNN's path's, operation for operation: a row's scale is its
largest magnitude over 127, its values round(x / scale) + 128 as uint8, their exact
int32 sums with the int8 weights less 128 times each channel's sum of weights, the sum
as float times the channel's scale, times the row's scale (with the bias, addcmul's
fused multiply-add). So int8 results, translations and scores are the same bits
through either kernel (tested), and a row's result is its own alone or in any batch.

Built on first use (transduce/native.py); TRANSDUCE_INT8_VNNI_KERNEL=0 turns it off and
int8 products take oneDNN's kernel.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transduce.model.int8 import Int8Layer, activation_range, quantize_weight
from transduce.native import NativeKernel

SOURCE = Path(__file__).with_name("int8_vnni.cpp")
SWITCH = "TRANSDUCE_INT8_VNNI_KERNEL"
# -fopenmp: ATen's parallel_for is inline, and runs on one thread where it is compiled
# without OpenMP (with it, the kernel takes PyTorch's own OpenMP threads).
KERNEL = NativeKernel(SOURCE, "int8 VNNI", SWITCH, "int8 products use oneDNN's kernel instead",
                      extra_cflags=("-ffp-contract=off", "-fopenmp"))
BLOCK = 64        # output channels a block of the kernel's layout
GROUP = 4         # columns one 32-bit lane holds
FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})


def available() -> bool:
    """Whether the kernel runs here: a CPU with AVX512-VNNI (where oneDNN's rows take 8
    bits too) and a build."""
    from transduce.runtime import cpu_flags

    return FLAGS <= cpu_flags() and activation_range() == (127, 128) and KERNEL.available()


def layout(values: Tensor) -> Tensor:
    """int8 weights (N, K) -> (Np / 64, Kp / 4, 64, 4) as the kernel reads them: padded with
    zeros to a multiple of 64 rows and 4 columns, each block of 64 channels laid out four
    columns at a time, so that one register holds four columns of 16 channels."""
    padded = F.pad(values, (0, -values.shape[1] % GROUP, 0, -values.shape[0] % BLOCK))
    rows, columns = padded.shape
    blocks = padded.view(rows // BLOCK, BLOCK, columns // GROUP, GROUP)
    return blocks.transpose(1, 2).contiguous()                # (Np / 64, Kp / 4, 64, 4)


class Int8VnniLinear(Int8Layer):
    """A Linear with int8 weights (one scale per output channel) whose rows are quantized
    to 8 bits at every call, for CPU inference (Int8Layer). (..., in) -> (..., out),
    float32, the bits of Int8Linear's. The weight is held as the kernel reads it
    (layout), with its zero point's compensation."""

    def __init__(self, linear: nn.Linear, activation: str = "none"):
        if not available():
            raise RuntimeError("the int8 VNNI kernel does not run here: "
                               "int8_vnni.available() is False")
        values, scales = quantize_weight(linear.weight)
        super().__init__(linear, activation, scales)
        self.register_buffer("weight_values", layout(values), persistent=False)
        self.register_buffer("compensation", values.sum(dim=1, dtype=torch.int32) * 128,
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.transduce.int8_vnni_linear(x, self.weight_values, self.compensation,
                                                    self.weight_scale, self.bias, self.relu)
