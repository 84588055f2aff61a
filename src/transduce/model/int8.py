"""Int8 Linear layers for decoding on CPUs: weights int8 with one scale per output
channel, activations quantized per row at every call, multiplied by oneDNN's int8
product (VNNI on Zen 4 and Cascade Lake or later), the ops torch.compile's x86
quantization lowers to.

Per row, not per tensor: one scale for a whole batch would make a sentence's result
depend on its batch mates; with a scale per row each row's integers, their exact int32
sums and the rescaling are its own, so a product gives a row the same result alone or in
any batch. (What reaches a product can still differ in its last bits with a batch's
padding, and a quantized value then moves by a step: 3 of 500 test verses translate
differently alone than in batches with every product in int8, none in float32.)
The activation scale is the row's largest magnitude over 127, stored unsigned with zero
point 128 (what the u8 x s8 instructions multiply), on a CPU with VNNI, whose
instruction sums each u8 x s8 product in int32. Without it (AVX2 alone, or AVX-512
before Cascade Lake), oneDNN adds products in pairs in int16 first (vpmaddubsw), which
saturates beyond 32,767, as 255 x 127 x 2 does: a random Linear of 64 inputs came out
9-19% off (relative error) on an AVX2-only EPYC. There a row takes 7 bits, 63 levels
each side of zero point 64 (127 x 127 x 2 = 32,258 fits; FBGEMM's reduce_range): 1.2%
off, a rounding step twice 8 bits'.

Quantizing a row costs a few elementwise operators whatever the layer's width (an int8
product of a few rows takes about 12 us more than a packed float32 one, 13-25 us, at
one thread), while the product's saving grows with its rows and weights. On a 2-core
Zen 4 at one thread (torch 2.13), int8 took 0.45-0.60x packed float32's time for the small
preset's 256 x 1,024 feed-forward products at 128 rows (a batch of 32 at beam 4),
0.60-0.74x at 32 rows (greedy), 1.1-1.2x at 1-4 rows; 256 x 256 products 0.82x at 128
rows, 1.1x at 32 and 1.8x at 1-4. In whole translations (batches of 32, two workers,
interleaved in one process), converting every product of the small preset ran 1.12x at
beam 4 and 1.17x greedy over converting the output projection alone, and one sentence
at a time level with it (1.02x beam 4, 0.97x greedy, inside the spread), 0.02-0.05 BLEU
apart. So every product from 2^16 weights on (d_model 256 and up) is converted
(`worth_int8`); smaller ones, whose operators around the product cost more than it
saves at any batch, stay float32.

On a CPU with AVX512-VNNI, decoding copies take model/int8_vnni.py's kernel instead,
which computes this layer's bits in one call, without the operators around the product
(the figures above are this layer's).
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

# Products with fewer weights stay float32 (see above).
MIN_INT8_WEIGHTS = 1 << 16
# The u8 x s8 instructions that sum each product in int32 (see above).
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def no_scalars() -> List[Optional[Union[int, float, complex]]]:
    """The empty `scalars` argument of oneDNN's fused Linear ops, typed for TorchScript
    (which would type a bare [] as a list of tensors)."""
    return torch.jit.annotate(List[Optional[Union[int, float, complex]]], [])


def int8_available() -> bool:
    """Whether this PyTorch build has oneDNN's int8 Linear ops."""
    try:
        onednn = torch.ops.onednn
        return torch.backends.mkldnn.is_available() and \
            hasattr(onednn, "qlinear_prepack") and hasattr(onednn, "qlinear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def activation_range() -> tuple[int, int]:
    """(levels each side of zero, zero point) of the activations' uint8: 8 bits on a CPU
    with VNNI, 7 elsewhere, so that no pair of products saturates (see above). The flags
    are Linux's; where they cannot be read, 7 bits, which are right on any CPU."""
    from transduce.runtime import cpu_flags

    return (127, 128) if cpu_flags() & VNNI_FLAGS else (63, 64)


def worth_int8(linear: nn.Linear) -> bool:
    """Whether `linear` runs faster in int8 than packed float32 (see the module's note)."""
    return linear.in_features * linear.out_features >= MIN_INT8_WEIGHTS


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight (out, in) -> int8 values (out, in) and float32 scales (out,), symmetric
    per output channel: weight ~= values * scales[:, None]."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    values = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return values, scales


def quantize_rows(x: Tensor, levels: int = 127, zero_point: int = 128
                  ) -> Tuple[Tensor, Tensor]:
    """x (N, in) float32 -> uint8 (N, in) with `levels` steps each side of `zero_point`
    (activation_range), and each row's scale (N, 1): x ~= (values - zero_point) * scale."""
    # abs().amax(): vector_norm(inf) gives the same 5-20x slower on CPU. A literal, not a
    # global, as TorchScript compiles this: float32's smallest normal number. Through
    # int16: PyTorch's float -> uint8 copy is slow on CPU, and quantizing 128 rows of
    # 1,024 took 0.72x the time this way (one row: 1.1x).
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1.1754943508222875e-38)
    scale = scale.div_(float(levels))
    values = torch.div(x, scale).round_().add_(zero_point).to(torch.int16).to(torch.uint8)
    return values, scale


class Int8Layer(nn.Module):
    """What the int8 Linear layers share (Int8Linear, int8_rows.py's, int8_vnni.py's):
    the Linear's sizes, the activation ("none", or "relu" applied after the product: the
    float FeedForward's fused ReLU), the weight's scales per output channel (scales, from
    quantize_weight) and its bias in float32, as buffers that are no state-dict entries.
    Each subclass holds the int8 values in its kernel's layout."""

    def __init__(self, linear: nn.Linear, activation: str, scales: Tensor):
        super().__init__()
        if activation not in ("none", "relu"):
            raise ValueError(f"activation {activation!r}: {type(self).__name__} applies "
                             f"none or relu")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.activation = activation
        self.relu = activation == "relu"
        self.register_buffer("weight_scale", scales, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, activation={self.activation}"


class Int8Linear(Int8Layer):
    """A Linear with int8 weights for CPU inference, float32 in and out, through oneDNN's
    int8 product. (..., in) -> (..., out). The int8 weight lives in oneDNN's layout."""

    def __init__(self, linear: nn.Linear, activation: str = "none"):
        values, scales = quantize_weight(linear.weight)
        super().__init__(linear, activation, scales)
        self.levels, self.zero_point = activation_range()
        self.register_buffer("packed_weight", torch.ops.onednn.qlinear_prepack(values, None),
                             persistent=False)
        self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.long),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)                              # (N, in)
        values, scale = quantize_rows(rows, self.levels, self.zero_point)
        products = torch.ops.onednn.qlinear_pointwise(
            values, 1.0, self.zero_point, self.packed_weight, self.weight_scale,
            self.weight_zero_point, None, 1.0, 0, torch.float32, "none", no_scalars(), "")
        bias = self.bias
        out = products.mul_(scale) if bias is None else \
            torch.addcmul(bias, products, scale)                            # (N, out)
        if self.relu:
            out.relu_()
        return out.view(list(x.shape[:-1]) + [self.out_features])
