"""A bfloat16 copy of a model, for decoding.

On CPUs with AMX or AVX512-BF16, oneDNN multiplies bfloat16 matrices several times
faster than float32 ones, but plain F.linear re-lays the weight out into oneDNN's
blocked format at every call. Here each Linear's weight is laid out once
(PackedLinear, through the oneDNN ops that torch.compile's CPU backend uses for frozen
weights): the decoder's projections take 30-50% less time at 128 rows, the output
projection half (bench/decode.py measures the whole effect). Where those ops are
missing, the copy keeps plain bfloat16 Linear layers.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from transduce.model.layers import FeedForward


def packing_available() -> bool:
    """Whether this PyTorch build and CPU can run oneDNN's packed bfloat16 Linear."""
    try:
        return torch.backends.mkldnn.is_available() and \
            torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a build without these ops
        return False


class PackedLinear(nn.Module):
    """A bfloat16 Linear whose weight is held in oneDNN's layout (inference on CPU only;
    the packed weight is not a state-dict entry). (..., in) -> (..., out)."""

    def __init__(self, linear: nn.Linear, activation: str = "none"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.activation = activation   # "none", or "relu" applied inside the product
        weight = linear.weight.detach().to(torch.bfloat16)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None),
                             persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                  self.activation, [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, activation={self.activation}"


def bfloat16_copy(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """model's weights cast to bfloat16 in a copy for inference (model is left as it
    is); on a CPU that supports it, its Linear layers packed."""
    clone = copy.deepcopy(model).to(device=device, dtype=torch.bfloat16).eval()
    if torch.device(device).type == "cpu" and packing_available():
        for module in list(clone.modules()):   # the feed-forward ReLU, fused in its product
            if isinstance(module, FeedForward) and type(module.activation) is nn.ReLU:
                module.linear1 = PackedLinear(module.linear1, activation="relu")
                module.activation = nn.Identity()
        for parent in list(clone.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, PackedLinear(child))
    return clone
