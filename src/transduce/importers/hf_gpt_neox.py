"""Hugging Face GPT-NeoX (GPTNeoXForCausalLM or GPTNeoXModel directories: the Pythia
suite, 14M to 12B with its training checkpoints, GPT-NeoX-20B, RedPajama-INCITE, Dolly
v2) -> our DecoderOnly.

GPT-NeoX is a pre-norm decoder with LayerNorms and biases everywhere, exact GELU, an
output of its own (untied), and two things of its own, each a field of ours:

- parallel residuals: a layer adds its attention and its feed-forward network, each
  after its own norm, to the same input (use_parallel_residual: parallel_residual);
- rotary positions on a quarter of each head's features (rotary_pct or
  partial_rotary_factor: rotary_dims). GPT-NeoX rotates the first R features in pairs
  (i, i + R/2); ours pairs features (j, j + D/2), so each head's query and key rows are
  reordered (positional.partial_rotary_order), which leaves every score as it was.

    embed_in                            decoder.embed.embedding
    layers.N.input_layernorm            decoder.layers.N.norm1 (before attention)
    layers.N.attention.query_key_value  q_proj, k_proj, v_proj: stored per head, each
                                        head's query, key and value rows together
    layers.N.attention.dense            self_attn.out_proj
    layers.N.post_attention_layernorm   norm3 (before the FFN)
    layers.N.mlp.dense_h_to_4h, dense_4h_to_h   ffn.linear1, ffn.linear2
    final_layer_norm                    decoder.final_norm
    embed_out (transformers 5: lm_head) output_proj

The tokenizer.json travels with the checkpoint, with <|endoftext|> as bos and eos (where
tokenizer_config.json names no others), as GPT-2's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor

from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import ForeignCheckpointError, check_tied_copy, refuse_unread, \
    take_weight, unprefixed_names
from transduce.importers.hf_bloom import megatron_layer
from transduce.importers.hf_gpt2 import END_OF_TEXT
from transduce.importers.hf_llama import check_special_ids, import_decoder, required_field, \
    rope_parameters
from transduce.model.positional import partial_rotary_order

MODEL_TYPES = ("gpt_neox",)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu-tanh", "gelu_fast": "gelu-tanh",
               "gelu_pytorch_tanh": "gelu-tanh", "relu": "relu", "silu": "silu"}
# Options whose other value changes what the model computes: name -> the value we have.
FIXED_OPTIONS = {"attention_bias": True}
SPECIALS = {"bos": END_OF_TEXT, "eos": END_OF_TEXT, "pad": None}
# causal-mask buffers and rotary tables that older checkpoints saved
_IGNORED = re.compile(r"^layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")


def import_gpt_neox(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face GPT-NeoX directory (config.json, model.safetensors, its
    shards or pytorch_model.bin, tokenizer.json) and write it as our checkpoint at `out`,
    replacing one there; nothing is written unless everything was read and checked."""
    return import_decoder(hf_dir, out, MODEL_TYPES, FIXED_OPTIONS, ("gelu", ACTIVATIONS),
                          SPECIALS, model_config, map_weights, "hf-gpt-neox")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """The "gpt2" preset's pre-norm LayerNorm layers with GPT-NeoX's sizes, rotary
    positions (on part of each head), parallel residuals and untied output."""
    def required(name: str) -> Any:
        return required_field(hf, config_file, name)

    vocab_size, d_model = required("vocab_size"), required("hidden_size")
    heads = required("num_attention_heads")
    try:
        config = preset("gpt2", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                        d_model=d_model, num_heads=heads, d_ff=required("intermediate_size"),
                        num_decoder_layers=required("num_hidden_layers"),
                        max_positions=required("max_position_embeddings"),
                        positional="rotary", activation=activation,
                        parallel_residual=hf.get("use_parallel_residual", True),
                        layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
                        dropout=hf.get("hidden_dropout", 0.0),
                        attention_dropout=hf.get("attention_dropout", 0.0),
                        tie_embeddings="all" if hf.get("tie_word_embeddings", False)
                        else "none", pad_id=tokenizer.pad_id)
        config = config.replace(**rotary_fields(hf, config_file, config.head_dim))
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    check_special_ids(hf, config_file, tokenizer, config)
    return config


def rotary_fields(hf: dict[str, Any], config_file: Path, head_dim: int,
                  default_fraction: float = 0.25) -> dict[str, Any]:
    """The rotary base, the rotated features of a head and their scaling, from
    rope_parameters (transformers 5) or, before, rotary_emb_base or rope_theta,
    rotary_pct or partial_rotary_factor (default_fraction where none is named), and
    rope_scaling (GPT-NeoX's names, StableLM's, Phi's): unscaled or "linear"; other
    kinds are refused."""
    parameters, key, kind = rope_parameters(hf, config_file)
    if kind not in ("default", "linear"):
        raise ForeignCheckpointError(f"{config_file}: {key}.rope_type={kind!r} is not "
                                     f"supported (only \"default\" and \"linear\")")
    fraction = parameters.get("partial_rotary_factor", hf.get(
        "partial_rotary_factor", hf.get("rotary_pct", default_fraction)))
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) \
            or not 0 < fraction <= 1:
        raise ForeignCheckpointError(f"{config_file}: partial_rotary_factor={fraction!r}: "
                                     f"must be a fraction of a head's features, above 0")
    dims = int(head_dim * fraction)        # (transformers' rounding)
    base = parameters.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    fields = {"rope_base": base,
              "rotary_dims": None if dims == head_dim else dims}
    if kind == "linear":
        fields |= {"rope_scaling": "linear", "rope_factor": parameters.get("factor")}
    return fields


def map_weights(tensors: dict[str, Tensor], config: ModelConfig,
                source: Path) -> dict[str, Tensor]:
    """GPT-NeoX's tensors -> our state dict (float32), each key accounted for and each
    shape checked against what the configuration gives; the query and key rows in our
    order of each head's features."""
    names = unprefixed_names(tensors, "gpt_neox.", source)
    c, dim = config.d_model, config.head_dim
    order = partial_rotary_order(dim, config.rotary_dims or dim)

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    embedding = take("embed_in.weight", config.tgt_vocab_size, c)         # (V, C)
    state = {"decoder.embed.embedding.weight": embedding}
    norms = {"decoder.final_norm": "final_layer_norm"}
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"layers.{i}"
        norms |= {f"{ours}.norm1": f"{theirs}.input_layernorm",
                  f"{ours}.norm3": f"{theirs}.post_attention_layernorm"}
        state.update(megatron_layer(take, config, ours, f"{theirs}.attention", f"{theirs}.mlp",
                                    order))
    for ours, theirs in norms.items():
        for part in ("weight", "bias"):
            state[f"{ours}.{part}"] = take(f"{theirs}.{part}", c)
    head = "lm_head.weight" if "lm_head.weight" in names else "embed_out.weight"
    if config.tie_embeddings == "none":
        state["output_proj.weight"] = take(head, config.tgt_vocab_size, c)
    else:
        check_tied_copy(tensors, names, source, head, embedding, "embed_in.weight",
                        "tie_word_embeddings is true")
        state["output_proj.weight"] = embedding
    refuse_unread(names, source, _IGNORED)
    return state
