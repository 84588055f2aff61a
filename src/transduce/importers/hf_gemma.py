"""Hugging Face Gemma 3 text models (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b and
their instruction-tuned twins) -> our DecoderOnly.

Gemma 3 is a Llama-shaped decoder (RMSNorm, rotary positions, grouped-query attention,
a gated feed-forward network, here with GELU's tanh form) with four choices of its own,
each a field of ours:

- local and global layers: five sliding-window layers to one over the whole context
  (layer_types, or sliding_window_pattern before transformers 5): attention_type
  "sliding" with full_attention_layers;
- rotary positions of two kinds: base 10,000 on the sliding layers (local_rope_base),
  1,000,000 on the full ones (rope_base, which rope_scaling may stretch);
- sandwich norms: each sub-layer's output normalized again before the residual sum
  (sandwich_norm), and each head's queries and keys normalized (qk_norm);
- token embeddings multiplied by sqrt(hidden_size) (scale_embeddings).

Its RMSNorm multiplies by (1 + w): the import adds 1 to every norm weight. The weights
otherwise map name by name:

    embed_tokens                        decoder.embed.embedding (and the tied output)
    layers.N.input_layernorm            decoder.layers.N.norm1 (before attention)
    layers.N.post_attention_layernorm   post_norm1 (on attention's output)
    layers.N.pre_feedforward_layernorm  norm3 (before the FFN)
    layers.N.post_feedforward_layernorm post_norm3 (on the FFN's output)
    layers.N.self_attn.*, mlp.*         as Llama's (importers/hf_llama.py)
    norm                                decoder.final_norm

Options we do not compute (score soft-capping, Gemma 2's; a query scale other than
1/sqrt(head_dim); bidirectional attention) are refused naming them, and nothing is
written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_foreign_options, refuse_unread, take_weight, unprefixed_names
from transduce.importers.chat_settings import with_chat_settings
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json
from transduce.importers.hf_llama import ACTIVATIONS, _IGNORED, check_special_ids, \
    layer_weights, output_projection, read_tokenizer, required_field, rope_fields, \
    save_import

MODEL_TYPES = ("gemma3_text",)
# Options whose other value changes what the model computes: name -> the value we have.
FIXED_OPTIONS = {"attention_bias": False, "attn_logit_softcapping": None,
                 "final_logit_softcapping": None, "use_bidirectional_attention": False}
SPECIAL_TOKENS = {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>"}
SLIDING, FULL = "sliding_attention", "full_attention"
# Our norm -> Gemma's, per layer: the weights whose (1 + w) becomes our w.
LAYER_NORMS = {"norm1": "input_layernorm", "post_norm1": "post_attention_layernorm",
               "norm3": "pre_feedforward_layernorm", "post_norm3": "post_feedforward_layernorm"}


def import_gemma(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face Gemma 3 text directory (config.json, model.safetensors or its
    shards, tokenizer.json) and write it as our checkpoint at `out`, replacing one
    there; nothing is written unless everything was read and checked."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    if hf.get("model_type") == "gemma3":
        raise ForeignCheckpointError(f"{config_file}: model_type='gemma3' is Gemma 3 with "
                                     f"vision (4B and larger); only its text-only models "
                                     f"(model_type 'gemma3_text': 270M, 1B) import here")
    activation = check_foreign_options(hf, config_file, MODEL_TYPES, FIXED_OPTIONS,
                                       "hidden_activation", "gelu_pytorch_tanh", ACTIVATIONS)
    tokenizer = with_chat_settings(read_tokenizer(hf_dir, hf.get("bos_token_id"),
                                                  SPECIAL_TOKENS), hf_dir)
    config = model_config(hf, config_file, tokenizer, activation)
    return save_import(hf_dir, out, config, tokenizer, map_weights, "hf-gemma")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """The "llama-small" preset with Gemma 3's sizes and choices."""
    def required(name: str) -> Any:
        return required_field(hf, config_file, name)

    vocab_size, layers = required("vocab_size"), required("num_hidden_layers")
    d_model, heads = required("hidden_size"), required("num_attention_heads")
    head_dim, scalar = required("head_dim"), hf.get("query_pre_attn_scalar", 256)
    usual = isinstance(head_dim, int) and isinstance(heads, int) and head_dim * heads == d_model
    if scalar != head_dim:
        raise ForeignCheckpointError(f"{config_file}: query_pre_attn_scalar={scalar} is not "
                                     f"supported (only head_dim={head_dim}: scores scaled "
                                     f"by 1/sqrt(head_dim))")
    try:
        config = preset("llama-small", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                        d_model=d_model, num_heads=heads,
                        head_size=None if usual else head_dim,    # d_model / heads
                        num_kv_heads=required("num_key_value_heads"),
                        d_ff=required("intermediate_size"), num_decoder_layers=layers,
                        max_positions=required("max_position_embeddings"),
                        **_attention_fields(hf, config_file, layers),
                        activation=activation, layer_norm_eps=hf.get("rms_norm_eps", 1e-6),
                        dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
                        qk_norm=True, sandwich_norm=True, scale_embeddings=True,
                        tie_embeddings="all" if hf.get("tie_word_embeddings", True) else "none",
                        pad_id=tokenizer.pad_id)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    check_special_ids(hf, config_file, tokenizer, config)
    return config


def _attention_fields(hf: dict[str, Any], config_file: Path, layers: Any) -> dict[str, Any]:
    """ModelConfig's attention and rotary fields: which layers slide (a window of S keys,
    the token's own among them: our S - 1 before it) and which attend to everything,
    and each kind's rotary positions."""
    kinds = _layer_types(hf, config_file, layers)
    full = [i for i, kind in enumerate(kinds) if kind == FULL]
    local_rope = _rope_of(hf, config_file, SLIDING)
    if local_rope.keys() - {"rope_base"}:
        raise ForeignCheckpointError(f"{config_file}: a scaled rotary position on the "
                                     f"sliding layers is not supported (only on the full "
                                     f"ones)")
    if len(full) == len(kinds):
        return _rope_of(hf, config_file, FULL)
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise ForeignCheckpointError(f"{config_file}: sliding_window={json.dumps(window)}: "
                                     f"must be an integer of at least 2")
    fields = {"attention_type": "sliding", "attention_window": window - 1}
    if not full:
        return {**fields, **local_rope}
    return {**fields, **_rope_of(hf, config_file, FULL), "full_attention_layers": tuple(full),
            "local_rope_base": local_rope["rope_base"]}


def _layer_types(hf: dict[str, Any], config_file: Path, layers: Any) -> list[str]:
    """Each layer's attention: layer_types (transformers 5), else every
    sliding_window_pattern-th layer full (6 by default) and the others sliding."""
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ForeignCheckpointError(f"{config_file}: num_hidden_layers={json.dumps(layers)}: "
                                     f"must be a positive integer")
    kinds = hf.get("layer_types")
    if kinds is None:
        pattern = hf.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ForeignCheckpointError(f"{config_file}: sliding_window_pattern="
                                         f"{json.dumps(pattern)}: must be a positive integer")
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or \
            any(kind not in (SLIDING, FULL) for kind in kinds):
        raise ForeignCheckpointError(f"{config_file}: layer_types must list "
                                     f"{json.dumps(SLIDING)} or {json.dumps(FULL)} for each "
                                     f"of the {layers} layers")
    return kinds


def _rope_of(hf: dict[str, Any], config_file: Path, kind: str) -> dict[str, Any]:
    """The rotary fields of one kind of layer, from rope_parameters keyed by layer type
    (transformers 5) or, before, rope_theta with rope_scaling (full layers) and
    rope_local_base_freq (sliding ones)."""
    parameters = hf.get("rope_parameters")
    if isinstance(parameters, dict) and kind in parameters:
        return rope_fields({"rope_parameters": parameters[kind],
                            "max_position_embeddings": hf.get("max_position_embeddings")},
                           config_file)
    if kind == SLIDING:
        return {"rope_base": hf.get("rope_local_base_freq", 10000.0)}
    return rope_fields({"rope_theta": hf.get("rope_theta", 1_000_000.0),
                        "rope_scaling": hf.get("rope_scaling"),
                        "max_position_embeddings": hf.get("max_position_embeddings")},
                       config_file)


def map_weights(tensors: dict[str, Tensor], config: ModelConfig,
                source: Path) -> dict[str, Tensor]:
    """Gemma 3's tensors -> our state dict (float32), each key accounted for and each
    shape checked; every norm's weight w read as 1 + w."""
    names = unprefixed_names(tensors, "model.", source)
    c = config.d_model

    def take(name: str, *shape: int) -> Tensor:
        tensor = take_weight(tensors, names, source, name, *shape)
        return tensor + 1.0 if name.endswith("norm.weight") else tensor

    embedding = take("embed_tokens.weight", config.tgt_vocab_size, c)    # (V, C)
    state = {"decoder.embed.embedding.weight": embedding,
             "decoder.final_norm.weight": take("norm.weight", c)}
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"layers.{i}"
        state.update(layer_weights(take, config, ours, theirs))
        for our_norm, their_norm in LAYER_NORMS.items():
            state[f"{ours}.{our_norm}.weight"] = take(f"{theirs}.{their_norm}.weight", c)
    state["output_proj.weight"] = output_projection(tensors, names, embedding, config, source)
    refuse_unread(names, source, _IGNORED)
    return state

