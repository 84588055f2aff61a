"""Hugging Face Phi (PhiForCausalLM or PhiModel directories: phi-1, phi-1_5, phi-2) ->
our DecoderOnly.

Phi is a pre-norm decoder with LayerNorms and biases everywhere and GPT-2's tanh GELU,
with three things of its own, each a field of ours:

- parallel residuals over one norm: a layer adds its attention and its feed-forward
  network, both reading the same normalized input, to that input (parallel_residual,
  shared_norm);
- rotary positions on part of each head's features (partial_rotary_factor, 0.4 in
  phi-2, 0.5 in phi-1 and 1.5: rotary_dims), the rotated ones first in pairs
  (i, i + R/2), so each head's query and key rows are reordered into ours
  (positional.partial_rotary_order), which leaves every score as it was;
- a bias on its output (lm_head.bias: output_bias).

    embed_tokens                              decoder.embed.embedding
    layers.N.input_layernorm                  decoder.layers.N.norm1 (the only one)
    layers.N.self_attn.q_proj, k_proj, v_proj self_attn.*, q and k rows reordered
    layers.N.self_attn.q_layernorm, k_layernorm   q_norm, k_norm (qk_layernorm; in the
                                              same order as the rows)
    layers.N.self_attn.dense                  self_attn.out_proj
    layers.N.mlp.fc1, fc2                     ffn.linear1, ffn.linear2
    final_layernorm                           decoder.final_norm
    lm_head (weight and bias)                 output_proj

The tokenizer.json travels with the checkpoint, with <|endoftext|> as bos and eos (where
tokenizer_config.json names no others), as GPT-2's. Phi-3 and Phi-4 are Llama's layout:
`import hf-llama`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from transduce.config import ModelConfig
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import refuse_unread, take_weight, unprefixed_names
from transduce.importers.hf_gpt2 import END_OF_TEXT
from transduce.importers.hf_gpt_neox import ACTIVATIONS, rotary_fields
from transduce.importers.hf_llama import import_decoder, llama_layer_config, \
    output_projection
from transduce.model.positional import heads_in_rotary_order

MODEL_TYPES = ("phi",)
SPECIALS = {"bos": END_OF_TEXT, "eos": END_OF_TEXT, "pad": None}
# transformers' default where config.json names no partial_rotary_factor
PHI_ROTARY_FRACTION = 0.5
# the projections whose rows are reordered, head by head
ROTATED = ("self_attn.q_proj", "self_attn.k_proj")


def import_phi(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face Phi directory (config.json, model.safetensors, its shards or
    pytorch_model.bin, tokenizer.json) and write it as our checkpoint at `out`,
    replacing one there; nothing is written unless everything was read and checked."""
    return import_decoder(hf_dir, out, MODEL_TYPES, {}, ("gelu_new", ACTIVATIONS),
                          SPECIALS, model_config, map_weights, "hf-phi")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """Phi's sizes on LayerNorm layers with biases, parallel over one norm, rotary
    positions on part of each head, an output bias and its dropouts."""
    return llama_layer_config(
        hf, config_file, tokenizer, activation, norm="layer", gated_ffn=False, bias=True,
        parallel_residual=True, shared_norm=True, output_bias=True,
        qk_norm=bool(hf.get("qk_layernorm", False)),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
        then=lambda config: {"dropout": hf.get("resid_pdrop", 0.0),
                             **rotary_fields(hf, config_file, config.head_dim,
                                             PHI_ROTARY_FRACTION)})


def map_weights(tensors: dict[str, Tensor], config: ModelConfig,
                source: Path) -> dict[str, Tensor]:
    """Phi's tensors -> our state dict (float32), each key accounted for and each shape
    checked against what the configuration gives; the query and key rows (and their
    norms) in our order of each head's features."""
    names = unprefixed_names(tensors, "model.", source)
    c, ff, dim = config.d_model, config.d_ff, config.head_dim
    q, kv = config.num_heads * dim, config.kv_heads * dim

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    def per_head(rows: Tensor) -> Tensor:               # (H * D, ...) in our order
        return heads_in_rotary_order(rows, dim, config.rotary_dims)

    embedding = take("embed_tokens.weight", config.tgt_vocab_size, c)   # (V, C)
    state = {"decoder.embed.embedding.weight": embedding}
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"layers.{i}"
        for ours_name, theirs_name, n_out, n_in in (
                ("self_attn.q_proj", "self_attn.q_proj", q, c),
                ("self_attn.k_proj", "self_attn.k_proj", kv, c),
                ("self_attn.v_proj", "self_attn.v_proj", kv, c),
                ("self_attn.out_proj", "self_attn.dense", c, q),
                ("ffn.linear1", "mlp.fc1", ff, c), ("ffn.linear2", "mlp.fc2", c, ff)):
            weight = take(f"{theirs}.{theirs_name}.weight", n_out, n_in)
            bias = take(f"{theirs}.{theirs_name}.bias", n_out)
            if ours_name in ROTATED:
                weight, bias = per_head(weight), per_head(bias)
            state[f"{ours}.{ours_name}.weight"], state[f"{ours}.{ours_name}.bias"] = \
                weight, bias
        for part in ("weight", "bias"):
            state[f"{ours}.norm1.{part}"] = take(f"{theirs}.input_layernorm.{part}", c)
            if config.qk_norm:          # over each head's features, in our order
                for name in ("q", "k"):
                    state[f"{ours}.self_attn.{name}_norm.{part}"] = per_head(take(
                        f"{theirs}.self_attn.{name}_layernorm.{part}", dim))
    for part in ("weight", "bias"):
        state[f"decoder.final_norm.{part}"] = take(f"final_layernorm.{part}", c)
    state["output_proj.weight"] = output_projection(tensors, names, embedding, config, source)
    state["output_proj.bias"] = take("lm_head.bias", config.tgt_vocab_size)
    refuse_unread(names, source)
    return state
