"""A decoder-only model (GPT, Llama) as one ONNX graph for the prompt and every step:

    decoder.onnx   tokens (R, T) int64, key_mask (R, P + T) bool, past_k.{i}, past_v.{i}
                   (R, Hkv, P, D) -> logits (R, T, V), present_k.{i}, present_v.{i}
                   (R, Hkv, P + T, D)

The prompt's prefill is the call with an empty past (P = 0); each later step passes
the present back as the past. key_mask marks the real tokens among the past and the new
ones: left-padded prompts of different lengths run as one batch, each token's position
counting from its row's first real token (the cumulative sum of key_mask), as in
DecoderOnly.forward with key_mask. Sliding-window attention (Mistral's) is the same graph
with the band in the mask: the past keeps every key (not the window's rolling cache), and
each query attends the attention_window positions before it; sliding layers among full
ones (Gemma 3's) get the band, the full ones the plain mask. Every size is dynamic; the
export is traced as the encoder-decoder's is (export/onnx.py says why).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from transduce.attention.kv_cache import ConcatKVCache
from transduce.export.onnx_files import traced_graph
from transduce.model import DecoderOnly
from transduce.onnx_format import DECODER, cache_names


class LanguageModelGraph(nn.Module):
    """One pass of new tokens over a past given as inputs; the present returned."""

    def __init__(self, model: DecoderOnly):
        super().__init__()
        c = model.config
        self.model, self.layers = model, c.num_decoder_layers
        self.window = c.attention_window if c.attention_type == "sliding" else None
        self.banded = [c.layer_attention_type(i) == "sliding" for i in range(self.layers)]

    def forward(self, tokens: Tensor, key_mask: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        """tokens (R, T), key_mask (R, P + T), then past k/v per layer -> logits
        (R, T, V) and the present k/v per layer."""
        past_len, steps = past[0].shape[2], tokens.shape[1]
        positions = (key_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, past_len:]  # (R, T)
        query_pos = torch.arange(steps, device=tokens.device)[:, None] + past_len
        key_pos = torch.arange(past_len + steps, device=tokens.device)[None, :]
        allowed = key_pos <= query_pos                                     # (T, P + T)
        step_mask = allowed[None, None] & key_mask[:, None, None, :]      # (R, 1, T, P + T)
        band_mask = step_mask if self.window is None else \
            step_mask & (query_pos - key_pos <= self.window)[None, None]
        caches = [ConcatKVCache(past[2 * i], past[2 * i + 1],
                                band_mask if self.banded[i] else step_mask)
                  for i in range(self.layers)]
        hidden = self.model.decoder(tokens, None, None, caches=caches, positions=positions)
        logits = self.model.logits(hidden)
        return (logits, *(t for cache in caches for t in (cache.k, cache.v)))


def export_language_model(model: DecoderOnly, out: Path, opset: int) -> list[str]:
    """Trace OUT/decoder.onnx from an example of the general case: two rows, one
    left-padded, two new tokens after a past of three -> the graphs written."""
    c = model.config
    layers, rows, past_len, step_len = c.num_decoder_layers, 2, 3, 2
    past = [torch.randn(rows, c.kv_heads, past_len, c.head_dim) for _ in range(2 * layers)]
    tokens = torch.randint(4, c.tgt_vocab_size, (rows, step_len))
    key_mask = torch.ones(rows, past_len + step_len, dtype=torch.bool)
    key_mask[1, :2] = False
    past_names, present_names = cache_names(layers, "past"), cache_names(layers, "present")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tracer notes on size checks taken at trace time
        with traced_graph(out / DECODER) as path:
            torch.onnx.export(
                LanguageModelGraph(model), (tokens, key_mask, *past), str(path),
                dynamo=False, opset_version=opset,
                input_names=["tokens", "key_mask", *past_names],
                output_names=["logits", *present_names],
                dynamic_axes={"tokens": {0: "rows", 1: "step_length"},
                              "key_mask": {0: "rows", 1: "present_length"},
                              "logits": {0: "rows", 1: "step_length"},
                              **{name: {0: "rows", 2: "past_length"} for name in past_names},
                              **{name: {0: "rows", 2: "present_length"} for name in present_names}})
    return [DECODER]
