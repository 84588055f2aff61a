"""Hugging Face Llama-family decoders (LlamaForCausalLM; Mistral, whose sliding window
is our sliding attention; Qwen2, whose query, key and value projections have biases;
Qwen3, which normalizes each head's queries and keys; Phi-3, whose projections are
stored fused) -> our DecoderOnly.

Llama is the decoder-only model with the field's later choices, each a field of ours:
pre-norm layers with RMSNorm (norm "rms") and a final norm, rotary positions in the
"rotate half" layout that RotaryEmbedding uses, SwiGLU feed-forward networks (gated_ffn,
activation "silu"), grouped-query attention (num_kv_heads), no biases, no embedding
scale, and an output projection of its own unless tie_word_embeddings. The weights map
name by name, with no transposition or permutation:

    embed_tokens                      decoder.embed.embedding
    layers.N.input_layernorm          decoder.layers.N.norm1 (before attention)
    layers.N.self_attn.q/k/v_proj     self_attn.q_proj, .k_proj, .v_proj (k, v: Hkv heads;
                                      Qwen2's with their biases: qkv_bias)
    layers.N.self_attn.o_proj         self_attn.out_proj
    layers.N.self_attn.q_norm/k_norm  self_attn.q_norm, .k_norm (Qwen3's RMSNorm over each
                                      head's head_dim features: qk_norm)
    layers.N.post_attention_layernorm norm3 (before the FFN)
    layers.N.mlp.gate/up/down_proj    ffn.linear1 (activated), .linear3, .linear2
    norm                              decoder.final_norm
    lm_head                           output_proj (must equal embed_tokens when tied)

Phi-3 stores each layer's query, key and value projections as one (qkv_proj: the
query's rows, then the key's, then the value's) and the gate and up projections as one
(gate_up_proj: the gate's rows first); they are split into ours. Its sliding window
covers every layer, as Mistral's.

Every key is accounted for (older checkpoints' rotary_emb.inv_freq buffers are skipped);
options we do not compute (rope scaling but Llama 3.1's and linear, a sliding window,
biases, a head size other than hidden_size / heads) are refused naming them, and nothing is written. The
tokenizer.json travels with the checkpoint, with the bos and eos tokens that
tokenizer_config.json names; a sequence starts with bos if its post-processor adds one,
as Llama's does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from torch import Tensor

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_foreign_options, check_tied_copy, refuse_unread, take_weight, unprefixed_names
from transduce.importers.chat_settings import with_chat_settings
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json, read_weights, tokenizer_settings
from transduce.model import empty_model

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu",
               "gelu_pytorch_tanh": "gelu-tanh", "gelu_new": "gelu-tanh", "relu": "relu"}
# Options whose other value changes what the model computes: name -> the value we have.
FIXED_OPTIONS = {"attention_bias": False, "mlp_bias": False}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")   # Qwen2's biased ones
_IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


def import_llama(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face Llama, Mistral, Qwen2, Qwen3 or Phi-3 directory (config.json,
    model.safetensors, its shards or pytorch_model.bin, tokenizer.json) and write it as
    our checkpoint at `out`, replacing one there; nothing is written unless everything
    was read and checked."""
    return import_decoder(hf_dir, out, MODEL_TYPES, FIXED_OPTIONS, ("silu", ACTIVATIONS),
                          None, model_config, map_weights, "hf-llama")


def import_decoder(hf_dir: Path | str, out: Path | str, model_types: tuple[str, ...],
                   fixed: dict[str, Any], activations: tuple[str, dict[str, str]],
                   specials: dict[str, str | None] | None, config_of: Callable[..., ModelConfig],
                   mapping: Callable[[dict[str, Tensor], ModelConfig, Path], dict[str, Tensor]],
                   command: str) -> Path:
    """What a language model's import does: config.json checked (model_types, the fixed
    options, hidden_act among activations' names, its default first), the tokenizer
    read (specials: its special tokens where its files name none; None: Llama's), the
    configuration made (config_of(hf, config file, tokenizer, activation)) and the
    weights mapped (mapping) and saved at `out` as the import `command` -> out."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    default, names = activations
    activation = check_foreign_options(hf, config_file, model_types, fixed, "hidden_act",
                                       default, names)
    tokenizer = with_chat_settings(read_tokenizer(hf_dir, hf.get("bos_token_id"), specials),
                                   hf_dir)
    config = config_of(hf, config_file, tokenizer, activation)
    return save_import(hf_dir, out, config, tokenizer, mapping, command)


def save_import(hf_dir: Path, out: Path, config: ModelConfig, tokenizer: HFTokenizer,
                mapping: Callable[[dict[str, Tensor], ModelConfig, Path], dict[str, Tensor]],
                command: str, **notes: Any) -> Path:
    """The directory's weights, mapped onto a model of `config` by mapping(tensors,
    config, source), saved with the tokenizer as our checkpoint at `out` (its origin the
    import `command`, with `notes` on how the weights differ from the directory's)
    -> out."""
    tensors, source = read_weights(hf_dir)
    model = empty_model(config)     # every weight is loaded next
    model.load_state_dict(mapping(tensors, config, source))
    del tensors          # the stored files are let go before the save copies the model
    origin = {"imported": command, "from": str(hf_dir.resolve()), "steps": None, **notes}
    return checkpoint.save(out, model.eval(), None, tokenizer, origin=origin)


def required_field(hf: dict[str, Any], config_file: Path, name: str) -> Any:
    """config.json's `name`, which must be there."""
    if name not in hf:
        raise ForeignCheckpointError(f"{config_file}: no {name!r}")
    return hf[name]


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """The "llama-small" preset with the sizes and options of a LlamaConfig."""
    d_model, heads = required_field(hf, config_file, "hidden_size"), \
        required_field(hf, config_file, "num_attention_heads")
    max_positions = required_field(hf, config_file, "max_position_embeddings")
    head_dim = hf.get("head_dim")     # Mistral NeMo's: not hidden_size / heads
    head_size = None if head_dim is None or (isinstance(heads, int) and heads and
                                            head_dim * heads == d_model) else head_dim
    return llama_layer_config(hf, config_file, tokenizer, activation, head_size=head_size,
                              **rope_fields(hf, config_file),
                              **_attention_window(hf, config_file, max_positions),
                              layer_norm_eps=hf.get("rms_norm_eps", 1e-6),
                              qkv_bias=hf.get("model_type") == "qwen2",
                              qk_norm=hf.get("model_type") == "qwen3")


def llama_layer_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                       activation: str, *, then: Callable[[ModelConfig], dict] | None = None,
                       **fields: Any) -> ModelConfig:
    """The "llama-small" preset with a Llama-like config.json's sizes (vocab_size,
    hidden_size, num_attention_heads, num_key_value_heads, intermediate_size,
    num_hidden_layers, max_position_embeddings), tying, pad id and attention dropout,
    and the family's `fields` (then(config): more fields that read the config, its
    head_dim); what our models cannot be is refused naming config.json."""
    def required(name: str) -> Any:
        return required_field(hf, config_file, name)

    vocab_size, heads = required("vocab_size"), required("num_attention_heads")
    try:
        config = preset("llama-small", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                        d_model=required("hidden_size"), num_heads=heads,
                        num_kv_heads=hf.get("num_key_value_heads") or heads,
                        d_ff=required("intermediate_size"),
                        num_decoder_layers=required("num_hidden_layers"),
                        max_positions=required("max_position_embeddings"),
                        activation=activation, dropout=0.0,
                        attention_dropout=hf.get("attention_dropout", 0.0),
                        tie_embeddings="all" if hf.get("tie_word_embeddings", False) else "none",
                        pad_id=tokenizer.pad_id, **fields)
        if then is not None:
            config = config.replace(**then(config))
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    check_special_ids(hf, config_file, tokenizer, config)
    return config


def check_special_ids(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                      config: ModelConfig) -> None:
    """The tokenizer fits the vocabulary, and its bos and eos tokens are the ids that
    config.json names (eos among them, where it lists several)."""
    if tokenizer.vocab_size > config.tgt_vocab_size:
        raise ForeignCheckpointError(f"{config_file}: vocab_size={config.tgt_vocab_size} is "
                                     f"smaller than the tokenizer's {tokenizer.vocab_size} "
                                     f"tokens")
    for name, token_id in (("bos_token_id", tokenizer.bos_id),
                           ("eos_token_id", tokenizer.eos_id)):
        given = hf.get(name)
        if given is not None and token_id not in (given if isinstance(given, list) else [given]):
            raise ForeignCheckpointError(
                f"{config_file}: {name}={json.dumps(given)} but the tokenizer's "
                f"{name.split('_')[0]} token {tokenizer.piece(token_id)!r} is {token_id}")


def _attention_window(hf: dict[str, Any], config_file: Path, max_positions: Any) -> dict:
    """ModelConfig's attention fields for the checkpoint's window: none (attention over
    the whole context), or a sliding window of S keys (Mistral v0.1's on every layer;
    Qwen's from layer max_window_layers on, or where layer_types says), the token's own
    among them, which is our "sliding" attention over the S - 1 tokens before it, the
    other layers attending over everything (full_attention_layers)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is None or isinstance(window, int) and isinstance(max_positions, int) \
            and window >= max_positions:
        return {}
    windowed = _windowed_layers(hf)
    if windowed is not None and not any(windowed):
        return {}
    if windowed is not None and isinstance(window, int) and window > 1:
        full = tuple(i for i, slides in enumerate(windowed) if not slides)
        return {"attention_type": "sliding", "attention_window": window - 1,
                **({"full_attention_layers": full} if full else {})}
    raise ForeignCheckpointError(f"{config_file}: sliding_window={json.dumps(window)} is not "
                                 f"supported here (only null, at least "
                                 f"max_position_embeddings={max_positions}, or Mistral's or "
                                 f"Qwen's window of at least 2 keys)")


def _windowed_layers(hf: dict[str, Any]) -> list[bool] | None:
    """Which layers attend through the window: every layer of a Mistral or a Phi-3; a Qwen's as
    layer_types says (transformers 5), else from layer max_window_layers on. None for
    the other families (a Llama has no window)."""
    layers = hf.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and layers > 0 else 1
    if hf.get("model_type") in ("mistral", "phi3"):
        return [True] * layers
    if hf.get("model_type") not in ("qwen2", "qwen3"):
        return None
    types = hf.get("layer_types")
    if isinstance(types, list):
        return [kind == "sliding_attention" for kind in types]
    first = hf.get("max_window_layers", 28)                # transformers' default
    first = first if isinstance(first, int) else 0
    return [i >= first for i in range(layers)]


def rope_parameters(hf: dict[str, Any], config_file: Path) -> tuple[dict[str, Any], str, str]:
    """config.json's rotary settings: rope_parameters (transformers 5), else
    rope_scaling (before; none: {}) -> (them, the key they were read under, their kind:
    "default", "linear", ...)."""
    parameters = hf.get("rope_parameters")
    key = "rope_parameters"
    if parameters is None:
        parameters, key = hf.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(parameters, dict):
        raise ForeignCheckpointError(f"{config_file}: {key} must be an object")
    return parameters, key, parameters.get("rope_type", parameters.get("type", "default"))


def rope_fields(hf: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """The rotary base and scaling as ModelConfig fields, from rope_parameters
    (transformers 5) or rope_theta and rope_scaling (before): unscaled, "linear" or
    "llama3" (Llama 3.1's); other kinds are refused."""
    parameters, key, kind = rope_parameters(hf, config_file)
    partial = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ForeignCheckpointError(f"{config_file}: partial_rotary_factor={partial!r} is "
                                     f"not supported (rotary positions turn every feature "
                                     f"of a head here)")
    fields = {"rope_base": parameters.get("rope_theta", hf.get("rope_theta", 10000.0))}
    if kind == "linear":
        return {**fields, "rope_scaling": "linear", "rope_factor": parameters.get("factor")}
    if kind == "llama3":
        return {**fields, "rope_scaling": "llama3", "rope_factor": parameters.get("factor"),
                "rope_low_freq_factor": parameters.get("low_freq_factor"),
                "rope_high_freq_factor": parameters.get("high_freq_factor"),
                "rope_original_positions": parameters.get(
                    "original_max_position_embeddings", hf.get("max_position_embeddings"))}
    if kind != "default":
        raise ForeignCheckpointError(f"{config_file}: {key}.rope_type={kind!r} is not "
                                     f"supported (only \"default\", \"linear\" and "
                                     f"\"llama3\")")
    return fields


def read_tokenizer(hf_dir: Path, bos_token_id: Any = None,
                   defaults: dict[str, str | None] | None = None) -> HFTokenizer:
    """The directory's tokenizer.json with the bos, eos and pad tokens that its
    tokenizer_config.json / special_tokens_map.json name (Llama's defaults: <s>, </s>,
    no pad token, so eos pads). Qwen2's names no bos ("bos_token": null): config.json's
    bos_token_id then, as transformers' generate starts an empty prompt from it, else
    eos. defaults: the special tokens where those files name none (Llama's)."""
    specials, found = tokenizer_settings(
        hf_dir, defaults or {"bos": "<s>", "eos": "</s>", "pad": None}, ("bos_token",))
    if "bos_token" in found and found["bos_token"] is None:
        specials["bos"] = bos_token_id if isinstance(bos_token_id, int) else specials["eos"]
    if not (hf_dir / TOKENIZER_JSON).is_file():
        hint = " (only tokenizer.model: save the tokenizer with transformers' " \
               "LlamaTokenizerFast to write one)" if (hf_dir / "tokenizer.model").is_file() \
            else ""
        raise ForeignCheckpointError(f"{hf_dir}: no {TOKENIZER_JSON}{hint}")
    return HFTokenizer.from_file(hf_dir / TOKENIZER_JSON, **specials)


def map_weights(tensors: dict[str, Tensor], config: ModelConfig,
                source: Path) -> dict[str, Tensor]:
    """Llama's tensors -> our state dict (float32), each key accounted for and each shape
    checked against what the configuration gives."""
    names = unprefixed_names(tensors, "model.", source)
    c = config.d_model

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    embedding = take("embed_tokens.weight", config.tgt_vocab_size, c)   # (V, C)
    state = {"decoder.embed.embedding.weight": embedding,
             "decoder.final_norm.weight": take("norm.weight", c)}
    split = fused_layer_weights if "layers.0.self_attn.qkv_proj.weight" in names else \
        layer_weights                                                    # (Phi-3's fused)
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"layers.{i}"
        state.update(split(take, config, ours, theirs))
        state[f"{ours}.norm1.weight"] = take(f"{theirs}.input_layernorm.weight", c)
        state[f"{ours}.norm3.weight"] = take(f"{theirs}.post_attention_layernorm.weight", c)
    state["output_proj.weight"] = output_projection(tensors, names, embedding, config, source)
    refuse_unread(names, source, _IGNORED)
    return state


def layer_weights(take: Callable[..., Tensor], config: ModelConfig, ours: str,
                  theirs: str) -> dict[str, Tensor]:
    """A layer's attention and feed-forward weights (Qwen2's query, key and value biases,
    Qwen3's and Gemma 3's norms of the queries and keys) under our names; take(name,
    *shape) reads one of theirs."""
    c, ff = config.d_model, config.d_ff
    q, kv = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
    state = {}
    for ours_name, theirs_name, n_out, n_in in (
            ("self_attn.q_proj", "self_attn.q_proj", q, c),
            ("self_attn.k_proj", "self_attn.k_proj", kv, c),
            ("self_attn.v_proj", "self_attn.v_proj", kv, c),
            ("self_attn.out_proj", "self_attn.o_proj", c, q),
            ("ffn.linear1", "mlp.gate_proj", ff, c),
            ("ffn.linear3", "mlp.up_proj", ff, c),
            ("ffn.linear2", "mlp.down_proj", c, ff)):
        state[f"{ours}.{ours_name}.weight"] = take(f"{theirs}.{theirs_name}.weight",
                                                   n_out, n_in)
        if config.qkv_bias and ours_name in QKV:
            state[f"{ours}.{ours_name}.bias"] = take(f"{theirs}.{theirs_name}.bias", n_out)
    if config.qk_norm and not config.qk_norm_per_head:       # (StableLM 2 12B's: its own)
        for name in ("q_norm", "k_norm"):
            state[f"{ours}.self_attn.{name}.weight"] = take(
                f"{theirs}.self_attn.{name}.weight", config.head_dim)
    return state


def fused_layer_weights(take: Callable[..., Tensor], config: ModelConfig, ours: str,
                        theirs: str) -> dict[str, Tensor]:
    """A Phi-3 layer's weights under our names: its fused qkv_proj and gate_up_proj
    split row-wise (query, key, value; gate, up)."""
    c, ff = config.d_model, config.d_ff
    q, kv = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
    qkv = take(f"{theirs}.self_attn.qkv_proj.weight", q + 2 * kv, c)
    gate_up = take(f"{theirs}.mlp.gate_up_proj.weight", 2 * ff, c)
    return {f"{ours}.self_attn.q_proj.weight": qkv[:q],
            f"{ours}.self_attn.k_proj.weight": qkv[q:q + kv],
            f"{ours}.self_attn.v_proj.weight": qkv[q + kv:],
            f"{ours}.self_attn.out_proj.weight": take(f"{theirs}.self_attn.o_proj.weight", c, q),
            f"{ours}.ffn.linear1.weight": gate_up[:ff], f"{ours}.ffn.linear3.weight": gate_up[ff:],
            f"{ours}.ffn.linear2.weight": take(f"{theirs}.mlp.down_proj.weight", c, ff)}


def output_projection(tensors: dict[str, Tensor], names: dict[str, str], embedding: Tensor,
                      config: ModelConfig, source: Path,
                      embedding_name: str = "embed_tokens.weight") -> Tensor:
    """lm_head (V, C): its own matrix, or the token embeddings (stored as
    embedding_name) when tied (a stored copy must then equal them)."""
    if config.tie_embeddings == "none":
        return take_weight(tensors, names, source, "lm_head.weight", *embedding.shape)
    check_tied_copy(tensors, names, source, "lm_head.weight", embedding, embedding_name,
                    "tie_word_embeddings is true")
    return embedding
