"""Hugging Face StableLM (StableLmForCausalLM directories: stablelm-2-1_6b and its chat
and Zephyr twins, stablelm-2-12b and its chat twin, stablelm-3b-4e1t) -> our DecoderOnly.

StableLM is Llama's layer (SwiGLU, grouped-query attention, no biases but, in
StableLM 2, on the query, key and value projections) with GPT-NeoX's LayerNorms (gain
and bias) and rotary positions on a quarter of each head, each a field of ours:
norm "layer", qkv_bias, rotary_dims. Its rotated features come first in pairs
(i, i + R/2), so each head's query and key rows are reordered into ours
(positional.partial_rotary_order), which leaves every score as it was.

    embed_tokens                           decoder.embed.embedding
    layers.N.input_layernorm               decoder.layers.N.norm1 (gain and bias)
    layers.N.self_attn.q_proj, k_proj, v_proj, o_proj   self_attn.*, q and k reordered
    layers.N.post_attention_layernorm      norm3
    layers.N.mlp.gate_proj, up_proj, down_proj   ffn.linear1, linear3, linear2
    norm                                   decoder.final_norm
    lm_head                                output_proj (tied or not)

StableLM 2 12B's layers are parallel over their one norm (use_parallel_residual:
parallel_residual with shared_norm, no post_attention_layernorm) and normalize each
head's queries and keys with a gain of that head's own (qk_layernorm: qk_norm with
qk_norm_per_head; layers.N.self_attn.q_layernorm.norms.H, k_layernorm.norms.H ->
self_attn.q_norm, k_norm, one row a head, in our order of its features).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from transduce.config import ModelConfig
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import refuse_unread, take_weight, unprefixed_names
from transduce.importers.hf_gpt2 import END_OF_TEXT
from transduce.importers.hf_gpt_neox import rotary_fields
from transduce.importers.hf_llama import ACTIVATIONS, import_decoder, layer_weights, \
    llama_layer_config, output_projection
from transduce.model.positional import heads_in_rotary_order

MODEL_TYPES = ("stablelm",)
SPECIALS = {"bos": END_OF_TEXT, "eos": END_OF_TEXT, "pad": None}


def import_stablelm(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face StableLM directory (config.json, model.safetensors, its
    shards or pytorch_model.bin, tokenizer.json) and write it as our checkpoint at `out`,
    replacing one there; nothing is written unless everything was read and checked."""
    return import_decoder(hf_dir, out, MODEL_TYPES, {}, ("silu", ACTIVATIONS),
                          SPECIALS, model_config, map_weights, "hf-stablelm")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """The "llama-small" preset with StableLM's sizes, LayerNorms, query, key and value
    biases (or none), rotary positions on part of each head, and StableLM 2 12B's
    parallel layers and norms of each head's queries and keys."""
    parallel, per_head = (bool(hf.get(name, False))
                          for name in ("use_parallel_residual", "qk_layernorm"))
    return llama_layer_config(
        hf, config_file, tokenizer, activation, norm="layer",
        layer_norm_eps=hf.get("layer_norm_eps", 1e-5), qkv_bias=hf.get("use_qkv_bias", False),
        parallel_residual=parallel, shared_norm=parallel, qk_norm=per_head,
        qk_norm_per_head=per_head,
        then=lambda config: rotary_fields(hf, config_file, config.head_dim))


def map_weights(tensors: dict[str, Tensor], config: ModelConfig,
                source: Path) -> dict[str, Tensor]:
    """StableLM's tensors -> our state dict (float32), each key accounted for and each
    shape checked against what the configuration gives; the query and key rows in our
    order of each head's features."""
    names = unprefixed_names(tensors, "model.", source)
    c, dim = config.d_model, config.head_dim

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    embedding = take("embed_tokens.weight", config.tgt_vocab_size, c)   # (V, C)
    state = {"decoder.embed.embedding.weight": embedding}
    norms = {"decoder.final_norm": "norm"}
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"layers.{i}"
        state.update(layer_weights(take, config, ours, theirs))
        for proj in ("q_proj", "k_proj"):        # rows per head, in our order
            for part in ("weight", "bias") if config.qkv_bias else ("weight",):
                key = f"{ours}.self_attn.{proj}.{part}"
                state[key] = heads_in_rotary_order(state[key], dim, config.rotary_dims)
        if config.qk_norm_per_head:
            state |= per_head_norms(take, config, ours, theirs)
        norms[f"{ours}.norm1"] = f"{theirs}.input_layernorm"
        if not config.shared_norm:
            norms[f"{ours}.norm3"] = f"{theirs}.post_attention_layernorm"
    for ours, theirs in norms.items():
        for part in ("weight", "bias"):
            state[f"{ours}.{part}"] = take(f"{theirs}.{part}", c)
    state["output_proj.weight"] = output_projection(tensors, names, embedding, config, source)
    refuse_unread(names, source)
    return state


def per_head_norms(take, config: ModelConfig, ours: str, theirs: str) -> dict[str, Tensor]:
    """StableLM 2 12B's q_layernorm and k_layernorm, a LayerNorm gain (no bias) for each
    head -> our q_norm and k_norm weights (H, D) and (Hkv, D), each head's features in
    our order."""
    state, dim = {}, config.head_dim
    for name, heads in (("q", config.num_heads), ("k", config.kv_heads)):
        gains = torch.stack([take(f"{theirs}.self_attn.{name}_layernorm.norms.{h}.weight", dim)
                             for h in range(heads)])                          # (H, D)
        state[f"{ours}.self_attn.{name}_norm.weight"] = heads_in_rotary_order(
            gains.reshape(-1), dim, config.rotary_dims).view(heads, dim)
    return state
