"""The encoder's layers for inference, written out operator by operator and compiled by
TorchScript: what decoder_step.py does for a decoder step, for the source.

A server encodes each request's sentences when they join a running search, often one
or two short sentences at a time, where Python's share of a pass through the modules
(module calls, attention's checks and kernel choice) is largest: written out, encoding
them with the cross-attention keys took 1.43-1.89 ms against 1.73-2.27 through the
modules (small preset, int8, one thread, 2-core Zen 4). The layers here call the
modules' kernels in the modules' order, so the memory is bit-identical (tested,
compiled and not); where TorchScript is missing or cannot compile them, the same code
runs as Python.

It covers what decoder_step.py covers but rotary positions (softmax attention with
fused projections, no rotary positions, scaled scores, the SDPA kernel; a score bias
enters as SDPA's float mask, built once for every layer); `build` says which.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from transduce.attention import masks
from transduce.attention.kernels import bias_as_mask
from transduce.attention.kinds import SoftmaxAttention
from transduce.attention.multihead import merge_heads
from transduce.model.decoder_step import FusedSelfAttention, WrittenFeedForward
from transduce.model.scripting import CompiledOnFirstCall, WrittenOut


def _supported(encoder: nn.Module) -> bool:
    """No disentangled positions; every layer's self-attention fused, softmax over all
    keys through SDPA, scaled scores, no rotary positions (a score bias enters as SDPA's
    float mask), no sandwich norms."""
    if encoder.relative_positions is not None:
        return False            # DeBERTa's disentangled positions: not written out here
    for layer in encoder.layers:
        attn = layer.self_attn
        if layer.post_norm1 is not None:
            return False
        if attn.qkv_proj is None or attn.rotary is not None or attn.impl != "sdpa" \
                or attn.query_factor != 1.0 or attn.softcap is not None \
                or type(attn.kind) is not SoftmaxAttention:
            return False
    return True


class _SelfAttention(FusedSelfAttention):
    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        """x (B, S, C), mask (B, 1, 1, S) -> (B, S, C)."""
        q, k, v = self.project(x)
        return self.out_proj(merge_heads(self.attend(q, k, v, mask)))


class _LayerPass(nn.Module):
    """EncoderLayer.forward in eval mode (no dropout)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.self_attention = _SelfAttention(layer.self_attn)
        self.norm_first, self.norm1, self.norm2 = layer.norm_first, layer.norm1, layer.norm2
        self.feed_forward = WrittenFeedForward(layer.ffn)

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        """x (B, S, C) -> (B, S, C)."""
        if self.norm_first:
            x = x + self.self_attention(self.norm1(x), mask)
            return x + self.feed_forward(self.norm2(x))
        x = self.norm1(x + self.self_attention(x, mask))
        return self.norm2(x + self.feed_forward(x))


class EncoderLayers(nn.Module):
    """The encoder's layers and final norm; the modules it holds are the encoder's own."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(_LayerPass(layer) for layer in encoder.layers)
        self.final_norm = encoder.final_norm

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        """x (B, S, C) embedded tokens, mask (B, 1, 1, S) -> memory (B, S, C)."""
        for layer in self.layers:
            x = layer(x, mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x


class EncoderPass(WrittenOut):
    """Encoder.forward for inference (see the module note). Built by decoding copies
    (model/packed.py) for encoders it supports (`build`); the layers are compiled on the
    first pass (`script=False` keeps them Python)."""

    def __init__(self, encoder: nn.Module, script: bool = True):
        self.encoder = encoder
        self.layers = CompiledOnFirstCall(EncoderLayers(encoder), script)
        self._layer_modules = list(encoder.layers.modules())

    supports = staticmethod(_supported)

    def covers(self, src: Tensor) -> bool:
        """Inference on a CPU: eval mode, no autograd, not traced (an ONNX export traces
        the modules), and no forward hook on a layer's module (the attention recorder's,
        a user's): hooks see the modules' calls, which the written-out layers skip."""
        return src.device.type == "cpu" and not self.encoder.training \
            and not torch.is_grad_enabled() and not torch.jit.is_tracing() \
            and not self._hooked()

    def _hooked(self) -> bool:
        return bool(nn.modules.module._global_forward_hooks
                    or nn.modules.module._global_forward_pre_hooks) \
            or any(module._forward_hooks or module._forward_pre_hooks
                   for module in self._layer_modules)

    def __call__(self, src: Tensor, src_mask: Tensor | None, **embed_inputs: Tensor) -> Tensor:
        """src (B, S), src_mask (B, 1, 1, S) or None -> memory (B, S, C), as Encoder.forward."""
        if src_mask is not None:
            if src_mask.dtype != torch.bool or src_mask.dim() > 4:
                raise ValueError(f"src_mask must be a boolean mask broadcastable to "
                                 f"(B, 1, 1, S), got {src_mask.dtype} {tuple(src_mask.shape)}")
            src_mask = masks.four_d(src_mask)
        x = self.encoder.embed(src, **embed_inputs)                             # (B, S, C)
        if self.encoder.score_bias is not None:     # built once for every layer
            length = src.shape[1]
            src_mask = bias_as_mask(self.encoder.score_bias(length, length), src_mask,
                                    length, length, x.dtype)
        return self.layers(x, src_mask)
