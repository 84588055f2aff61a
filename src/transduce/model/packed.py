"""Decoding copies of a model: its weights in the dtype decoding runs in, each Linear's
weight laid out once for oneDNN.

Plain F.linear multiplies through MKL, and a bfloat16 F.linear re-lays its weight out
into oneDNN's blocked format at every call. A decoder step multiplies a few rows by
every weight of the model, so it is bound by how fast weights stream from memory: on a
2-core Zen 4, MKL's float32 products of 1-8 rows read 6-25 GB/s, oneDNN's packed ones
30-45 GB/s (what a plain sum over memory reads). PackedLinear holds the weight in that
layout, through the oneDNN ops that torch.compile's CPU backend uses for frozen weights:
in bfloat16 the decoder's projections take 30-50% less time at 128 rows, in float32 a
GPT-2 step about 40% less at one row (bench/decode.py, bench/generate.py). Where those
ops are missing, the copy keeps plain Linear layers.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from transduce.attention.multihead import MultiHeadAttention
from transduce.model import int8_rows, int8_vnni
from transduce.model.decoder_only import DecoderOnly
from transduce.model.decoder_step import DecoderStep
from transduce.model.int8 import Int8Linear, int8_available, no_scalars, worth_int8
from transduce.model.int8_rows import Int8RowsLinear
from transduce.model.int8_vnni import Int8VnniLinear
from transduce.model.layers import DecoderLayer, EncoderLayer, FeedForward
from transduce.model.lora import merge_adapters
from transduce.model.encoder_pass import EncoderPass
from transduce.model.transformer import Decoder, Encoder


def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this PyTorch build and CPU can run oneDNN's packed Linear in `dtype`."""
    try:
        if not (torch.backends.mkldnn.is_available() and
                hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and
                hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and
                                          torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without these ops
        return False


class PackedLinear(nn.Module):
    """A Linear whose weight is held in oneDNN's layout, in the weight's dtype (inference
    on CPU only; the packed weight is not a state-dict entry). (..., in) -> (..., out)."""

    def __init__(self, linear: nn.Linear, activation: str = "none"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.activation = activation   # "none", or "relu" applied inside the product
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None),
                             persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                  self.activation, no_scalars(), "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, activation={self.activation}"


def decoding_copy(model: nn.Module, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", *, in_place: bool = False) -> nn.Module:
    """model's weights in `dtype` in a copy for inference (model is left as it is), each
    self-attention's query, key and value projections fused into one; on a CPU that
    supports it, its Linear layers packed. A tied output projection gets a packed matrix
    of its own (the embedding keeps its rows for lookups). Its decoder steps run written
    out where they can (model/decoder_step.py), and so do its encoder's layers
    (model/encoder_pass.py).

    in_place: `model` itself is converted and returned, for a caller done with it: a
    model as large as half the memory does not fit twice.
    dtype torch.int8: float32, with every product of 2^16 weights or more in int8, CPU
    only: a language model's through model/int8_rows.py where that kernel is preferred,
    else through oneDNN's (model/int8.py)."""
    int8 = dtype == torch.int8
    if int8 and (torch.device(device).type != "cpu" or not int8_available()):
        raise ValueError("int8 decoding runs on a CPU, through oneDNN's int8 ops "
                         f"(device {torch.device(device)}, ops available: {int8_available()})")
    weights = torch.float32 if int8 else dtype
    counted = model.num_parameters() if hasattr(model, "num_parameters") else None
    clone = (model if in_place else copy.deepcopy(model)).to(device=device, dtype=weights)
    clone.eval()
    merge_adapters(clone)     # a LoRA run's model, evaluated as it trains
    if counted is not None:                # packed weights are buffers (model/counting.py)
        clone.source_parameters = counted
    for module in clone.modules():
        if isinstance(module, (EncoderLayer, DecoderLayer)) and \
                isinstance(module.self_attn, MultiHeadAttention):
            module.self_attn.fuse_self_projections()
    packed = torch.device(device).type == "cpu" and packing_available(weights)
    if packed or int8:
        _replace_linear_layers(clone, packed, _int8_layer(clone) if int8 else None)
    if isinstance(getattr(clone, "decoder", None), Decoder):
        clone.decoder.fast_step = DecoderStep.build(clone.decoder)
    if isinstance(getattr(clone, "encoder", None), Encoder):
        clone.encoder.fast_pass = EncoderPass.build(clone.encoder)
    return clone


def _int8_layer(model: nn.Module) -> type[nn.Module]:
    """The int8 Linear of `model`'s products: on a CPU without VNNI, a language model's
    takes the int8 rows kernel where it is preferred (model/int8_rows.py); with
    AVX512-VNNI, the VNNI kernel (oneDNN's bits, faster: model/int8_vnni.py); else
    oneDNN's."""
    if isinstance(model, DecoderOnly) and int8_rows.preferred():
        return Int8RowsLinear
    return Int8VnniLinear if int8_vnni.available() else Int8Linear


def _replace_linear_layers(model: nn.Module, packed: bool, int8_layer: type | None) -> None:
    """Each Linear layer becomes an int8_layer (where given and worth it), a PackedLinear
    (packed) or stays; the feed-forward ReLU moves into its first product."""
    def converted(linear: nn.Linear, activation: str = "none") -> nn.Module | None:
        if int8_layer is not None and worth_int8(linear):
            return int8_layer(linear, activation)
        return PackedLinear(linear, activation) if packed else None

    # The lists name the modules to change, never the Linear layers: each replaced layer
    # is freed at once, and the conversion needs one layer's memory more, not the model's.
    relu_feed_forwards = [module for module in model.modules()
                          if isinstance(module, FeedForward) and type(module.activation) is nn.ReLU]
    for module in relu_feed_forwards:
        first = converted(module.linear1, activation="relu")
        if first is not None:
            module.linear1, module.activation = first, nn.Identity()
    parents = [module for module in model.modules()
               if any(type(child) is nn.Linear for child in module.children())]
    for parent in parents:
        for name in [name for name, child in parent.named_children() if type(child) is nn.Linear]:
            replacement = converted(getattr(parent, name))
            if replacement is not None:
                setattr(parent, name, replacement)


def bfloat16_copy(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """The bfloat16 decoding copy (AMX / AVX512-BF16 CPUs multiply it several times
    faster than float32)."""
    return decoding_copy(model, torch.bfloat16, device)
