"""Hugging Face Gemma 3 and Gemma 2 -> our DecoderOnly: Gemma 3's text models
(Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b and their instruction-tuned twins), the
language model of the larger ones, which read images too (Gemma3ForConditionalGeneration:
gemma-3-4b, 12b and 27b; their vision tower and its projector are left out, so they read
text only), and Gemma 2 (Gemma2ForCausalLM: gemma-2-2b, 9b, 27b).

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

A query_pre_attn_scalar other than head_dim (Gemma 3 27B's: scores q . k / sqrt(168)
over heads of 128; Gemma 2 9B's 224 over 256) is folded into each layer's q_norm gain,
or, without one (Gemma 2), its q_proj rows: the queries' scale passes through the rotary
rotation to the scores, so our usual 1/sqrt(head_dim) then gives Gemma's scores.

Gemma 2 is Gemma 3 without q/k norms, with one layer in two sliding (the first of each
pair), one rotary base for all, and its scores and logits soft-capped
(attn_logit_softcapping, final_logit_softcapping: our attention_softcap and
logit_softcap). Bidirectional attention is refused naming it, and nothing is written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
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

MULTIMODAL = "gemma3"          # Gemma3ForConditionalGeneration: its text_config is ours


@dataclass(frozen=True)
class Generation:
    """What sets a Gemma generation's configs apart.

    defaults: its config class's defaults, what transformers reads where config.json
    names nothing (the published Gemma 3 4B-27B text_configs name only what differs);
    fixed: options whose other value changes what the model computes -> the value we
    have; pattern: every pattern-th layer attends over everything where the config lists
    no layer kinds; qk_norm: its heads' queries and keys are normalized; shared_rope: one
    rotary position for every layer (rope_theta), not one per kind of layer."""

    defaults: dict[str, Any]
    fixed: dict[str, Any]
    pattern: int
    qk_norm: bool
    shared_rope: bool


COMMON_DEFAULTS = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
                   "bos_token_id": 2}
GENERATIONS = {
    "gemma3_text": Generation(
        {**COMMON_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072},
        {"attention_bias": False, "attn_logit_softcapping": None,
         "final_logit_softcapping": None, "use_bidirectional_attention": False},
        pattern=6, qk_norm=True, shared_rope=False),
    "gemma2": Generation(
        {**COMMON_DEFAULTS, "vocab_size": 256000, "max_position_embeddings": 8192,
         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        {"attention_bias": False, "use_bidirectional_attention": False},
        pattern=2, qk_norm=False, shared_rope=True),
}
MODEL_TYPES = tuple(GENERATIONS)
# What a multimodal config.json says at its top level about the text it generates.
TOP_LEVEL_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
# Where Gemma3ForConditionalGeneration stores its language model: transformers 4.50's
# layout (the published files; save_pretrained still writes it), then 4.52's.
TEXT_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
TEXT_HEADS = {"language_model.lm_head.weight": "lm_head.weight"}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")
SPECIAL_TOKENS = {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>"}
SLIDING, FULL = "sliding_attention", "full_attention"
PATTERN_KEYS = ("sliding_window_pattern", "_sliding_window_pattern")
PROJECTION_FACTOR = "q_proj_factor"    # the origin's note: q_proj's rows times this
# Our norm -> Gemma's, per layer: the weights whose (1 + w) becomes our w.
LAYER_NORMS = {"norm1": "input_layernorm", "post_norm1": "post_attention_layernorm",
               "norm3": "pre_feedforward_layernorm", "post_norm3": "post_feedforward_layernorm"}


def import_gemma(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face Gemma 3 directory (config.json, model.safetensors or its
    shards, tokenizer.json), a text model or a multimodal one's language model, and
    write it as our checkpoint at `out`, replacing one there; nothing is written unless
    everything was read and checked."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    stored = _read_json(hf_dir / HF_CONFIG)
    hf, where = text_config(stored, hf_dir / HF_CONFIG)
    activation = check_foreign_options(hf, where, MODEL_TYPES, generation_of(hf).fixed,
                                       "hidden_activation", "gelu_pytorch_tanh", ACTIVATIONS)
    tokenizer = with_chat_settings(read_tokenizer(hf_dir, hf.get("bos_token_id"),
                                                  SPECIAL_TOKENS), hf_dir)
    config = model_config(hf, where, tokenizer, activation)
    mapping = map_multimodal_weights if stored.get("model_type") == MULTIMODAL else map_weights
    factor = _query_factor(hf, where)
    # Without q_norm the factor sits in q_proj's rows, where a PEFT adapter's update of the
    # directory's q_proj must take it too (importers/peft.py reads this note).
    notes = {PROJECTION_FACTOR: factor} if factor != 1.0 and not config.qk_norm else {}
    return save_import(hf_dir, out, config, tokenizer,
                       partial(mapping, query_factor=factor), "hf-gemma", **notes)


def text_config(hf: dict[str, Any], config_file: Path) -> tuple[dict[str, Any], str]:
    """config.json -> the text model's settings, its config class's defaults filled in,
    and where errors should point: the file, or its text_config for a multimodal
    checkpoint (whose top-level special ids count where text_config names none).
    Gemma 2's use_bidirectional_attention null is false."""
    if hf.get("use_bidirectional_attention", False) is None:
        hf = {name: value for name, value in hf.items()
              if name != "use_bidirectional_attention"}
    if hf.get("model_type") != MULTIMODAL:
        return {**generation_of(hf).defaults, **hf}, str(config_file)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ForeignCheckpointError(f"{config_file}: model_type={MULTIMODAL!r} needs a "
                                     f"text_config object (the language model's settings)")
    text = {"model_type": "gemma3_text", **text}         # as Gemma3Config reads one without
    top = {name: hf[name] for name in TOP_LEVEL_FIELDS if name in hf}
    return {**generation_of(text).defaults, **top, **text}, f"{config_file} text_config"


def generation_of(hf: dict[str, Any]) -> Generation:
    """The Gemma generation a config is of (Gemma 3's where its model_type is none of
    ours: check_foreign_options names it then)."""
    return GENERATIONS.get(hf.get("model_type"), GENERATIONS["gemma3_text"])


def is_multimodal(hf_dir: Path | str) -> bool:
    """Whether the directory holds Gemma3ForConditionalGeneration (its vision tower is
    left out by the import)."""
    return _read_json(Path(hf_dir) / HF_CONFIG).get("model_type") == MULTIMODAL


def _query_factor(hf: dict[str, Any], where: str) -> float:
    """What the queries are multiplied by so that scores over sqrt(head_dim) become
    Gemma's scores over sqrt(query_pre_attn_scalar)."""
    scalar = hf["query_pre_attn_scalar"]
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not scalar > 0:
        raise ForeignCheckpointError(f"{where}: query_pre_attn_scalar={json.dumps(scalar)}: "
                                     f"must be a positive number")
    return math.sqrt(hf["head_dim"] / scalar)


def model_config(hf: dict[str, Any], config_file: Path | str, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """The "llama-small" preset with Gemma's sizes and choices (`hf` with its config
    class's defaults filled in)."""
    def required(name: str) -> Any:
        return required_field(hf, config_file, name)

    vocab_size, layers = required("vocab_size"), required("num_hidden_layers")
    d_model, heads = required("hidden_size"), required("num_attention_heads")
    head_dim = required("head_dim")
    usual = isinstance(head_dim, int) and isinstance(heads, int) and head_dim * heads == d_model
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
                        qk_norm=generation_of(hf).qk_norm, sandwich_norm=True,
                        scale_embeddings=True,
                        attention_softcap=hf.get("attn_logit_softcapping"),
                        logit_softcap=hf.get("final_logit_softcapping"),
                        tie_embeddings="all" if hf.get("tie_word_embeddings", True) else "none",
                        pad_id=tokenizer.pad_id)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    check_special_ids(hf, config_file, tokenizer, config)
    return config


def _attention_fields(hf: dict[str, Any], config_file: Path | str, layers: Any) -> dict[str, Any]:
    """ModelConfig's attention and rotary fields: which layers slide (a window of S keys,
    the token's own among them: our S - 1 before it) and which attend to everything,
    and each kind's rotary positions."""
    kinds = _layer_types(hf, config_file, layers)
    full = [i for i, kind in enumerate(kinds) if kind == FULL]
    if generation_of(hf).shared_rope:
        rope = rope_fields(hf, config_file)
        window = _window(hf, config_file) if len(full) < len(kinds) else {}
        return {**rope, **window, **({"full_attention_layers": tuple(full)}
                                     if window and full else {})}
    local_rope = _rope_of(hf, config_file, SLIDING)
    if local_rope.keys() - {"rope_base"}:
        raise ForeignCheckpointError(f"{config_file}: a scaled rotary position on the "
                                     f"sliding layers is not supported (only on the full "
                                     f"ones)")
    if len(full) == len(kinds):
        return _rope_of(hf, config_file, FULL)
    fields = _window(hf, config_file)
    if not full:
        return {**fields, **local_rope}
    return {**fields, **_rope_of(hf, config_file, FULL), "full_attention_layers": tuple(full),
            "local_rope_base": local_rope["rope_base"]}


def _window(hf: dict[str, Any], config_file: Path | str) -> dict[str, Any]:
    """The sliding layers' fields: a window of S keys, the token's own among them, is
    our window of S - 1 before it."""
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise ForeignCheckpointError(f"{config_file}: sliding_window={json.dumps(window)}: "
                                     f"must be an integer of at least 2")
    return {"attention_type": "sliding", "attention_window": window - 1}


def _layer_types(hf: dict[str, Any], config_file: Path | str, layers: Any) -> list[str]:
    """Each layer's attention: layer_types (transformers 5), else every
    sliding_window_pattern-th layer full (_sliding_window_pattern in transformers 4.53
    to 4.57; by default Gemma 3's 6, Gemma 2's 2) and the others sliding."""
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ForeignCheckpointError(f"{config_file}: num_hidden_layers={json.dumps(layers)}: "
                                     f"must be a positive integer")
    kinds = hf.get("layer_types")
    if kinds is None:
        key = next((key for key in PATTERN_KEYS if hf.get(key) is not None), PATTERN_KEYS[0])
        pattern = hf.get(key, generation_of(hf).pattern)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ForeignCheckpointError(f"{config_file}: {key}={json.dumps(pattern)}: must "
                                         f"be a positive integer")
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or \
            any(kind not in (SLIDING, FULL) for kind in kinds):
        raise ForeignCheckpointError(f"{config_file}: layer_types must list "
                                     f"{json.dumps(SLIDING)} or {json.dumps(FULL)} for each "
                                     f"of the {layers} layers")
    return kinds


def _rope_of(hf: dict[str, Any], config_file: Path | str, kind: str) -> dict[str, Any]:
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


def map_weights(tensors: dict[str, Tensor], config: ModelConfig, source: Path,
                query_factor: float = 1.0) -> dict[str, Tensor]:
    """Gemma3ForCausalLM's tensors -> our state dict: see text_model_weights."""
    return text_model_weights(tensors, unprefixed_names(tensors, "model.", source), config,
                              source, query_factor)


def map_multimodal_weights(tensors: dict[str, Tensor], config: ModelConfig, source: Path,
                           query_factor: float = 1.0) -> dict[str, Tensor]:
    """Gemma3ForConditionalGeneration's tensors -> our state dict: its language model's,
    under either layout's prefix; the vision tower and its projector are left out."""
    names: dict[str, str] = {}
    for key in tensors:
        if key.startswith(VISION_PREFIXES):
            continue
        name = next((key.removeprefix(prefix) for prefix in TEXT_MODEL_PREFIXES
                     if key.startswith(prefix)), key)
        name = TEXT_HEADS.get(name, name)
        if name in names:
            raise ForeignCheckpointError(f"{source}: {key!r} and {names[name]!r} are the "
                                         f"same weight stored twice")
        names[name] = key
    return text_model_weights(tensors, names, config, source, query_factor)


def text_model_weights(tensors: dict[str, Tensor], names: dict[str, str], config: ModelConfig,
                       source: Path, query_factor: float) -> dict[str, Tensor]:
    """Gemma's tensors (`names`: its text model's names -> the stored keys) -> our state
    dict (float32), each key accounted for and each shape checked; every norm's weight w
    read as 1 + w; the queries' norm, or their projection where they have no norm, times
    query_factor (see the module's notes)."""
    c = config.d_model
    scaled = "self_attn.q_norm.weight" if config.qk_norm else "self_attn.q_proj.weight"

    def take(name: str, *shape: int) -> Tensor:
        tensor = take_weight(tensors, names, source, name, *shape)
        if name.endswith("norm.weight"):
            tensor = tensor + 1.0
        return tensor * query_factor if name.endswith(scaled) else tensor

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

