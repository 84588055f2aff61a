"""Hugging Face BLOOM (BloomForCausalLM or BloomModel directories: bloom-560m ... bloom-7b1,
BLOOMZ) -> our DecoderOnly.

BLOOM is GPT-2's layout (pre-norm LayerNorms with biases and a final one, tanh-
approximated GELU, biases on every projection, the output tied to the token embeddings)
with two changes, each a field of ours:

- no position table: ALiBi's head slopes bias the scores (positional "alibi"; BLOOM's
  bias grows with the key's position, ours falls with the distance from the query: the
  two differ by a constant per query, which softmax ignores);
- the token embeddings pass through a LayerNorm (word_embeddings_layernorm):
  embedding_norm.

    word_embeddings                 decoder.embed.embedding (and the tied output)
    word_embeddings_layernorm       decoder.embed.norm
    h.N.input_layernorm             decoder.layers.N.norm1 (before attention)
    h.N.self_attention.query_key_value   q_proj, k_proj, v_proj: stored per head, each
                                    head's query, key and value rows together
    h.N.self_attention.dense        self_attn.out_proj
    h.N.post_attention_layernorm    norm3 (before the FFN)
    h.N.mlp.dense_h_to_4h, dense_4h_to_h   ffn.linear1, ffn.linear2
    ln_f                            decoder.final_norm

ALiBi has no length limit; our caches do: max_positions is config.json's seq_length
(2,048 where it names none, BLOOM's training length). The tokenizer.json travels with
the checkpoint, with tokenizer_config.json's <s>, </s> and <pad>.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch import Tensor

from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_tied_copy, check_type_and_fixed_options, refuse_unread, take_weight, \
    unprefixed_names
from transduce.importers.chat_settings import with_chat_settings
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json
from transduce.importers.hf_llama import check_special_ids, read_tokenizer, required_field, \
    save_import

# Options whose other value changes what the model computes: name -> the value we have.
FIXED_OPTIONS = {"apply_residual_connection_post_layernorm": False, "tie_word_embeddings": True}
TRAINING_LENGTH = 2048
SPECIALS = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}


def import_bloom(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face BLOOM directory (config.json, model.safetensors, its shards or
    pytorch_model.bin, tokenizer.json) and write it as our checkpoint at `out`,
    replacing one there; nothing is written unless everything was read and checked."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    check_type_and_fixed_options(hf, config_file, "bloom", FIXED_OPTIONS)
    tokenizer = with_chat_settings(read_tokenizer(hf_dir, hf.get("bos_token_id"), SPECIALS),
                                   hf_dir)
    config = model_config(hf, config_file, tokenizer)
    return save_import(hf_dir, out, config, tokenizer,
                       lambda tensors, config, source: map_weights(tensors, config, hf, source),
                       "hf-bloom")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer) -> ModelConfig:
    """The "gpt2" preset (its tanh-approximated GELU is BLOOM's) with BLOOM's sizes, ALiBi
    and the embeddings' norm."""
    def required(*names: str) -> Any:      # (older files name the width n_embed)
        for name in names:
            if name in hf:
                return hf[name]
        return required_field(hf, config_file, names[0])

    vocab_size, d_model = required("vocab_size"), required("hidden_size", "n_embed")
    try:
        config = preset("gpt2", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                        d_model=d_model, num_heads=required("n_head", "num_attention_heads"),
                        num_decoder_layers=required("n_layer", "num_hidden_layers"),
                        d_ff=4 * d_model if isinstance(d_model, int) else d_model,
                        max_positions=hf.get("seq_length") or TRAINING_LENGTH,
                        positional="alibi", embedding_norm=True,
                        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                        dropout=hf.get("hidden_dropout", 0.0),
                        attention_dropout=hf.get("attention_dropout", 0.0),
                        pad_id=tokenizer.pad_id)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    check_special_ids(hf, config_file, tokenizer, config)
    return config


def megatron_layer(take: Callable[..., Tensor], config: ModelConfig, ours: str,
                   attention: str, mlp: str, order: Tensor | None = None) -> dict[str, Tensor]:
    """A layer's attention and feed-forward weights in Megatron's names (BLOOM's and
    GPT-NeoX's: query_key_value fused head by head, each head's query, key and value
    rows together, dense, dense_h_to_4h, dense_4h_to_h, all with biases) under ours;
    order: each head's query and key rows in our order (positional.partial_rotary_order)."""
    c, ff, heads, dim = config.d_model, config.d_ff, config.num_heads, config.head_dim
    weight = take(f"{attention}.query_key_value.weight", 3 * c, c)       # (H, 3, D, C)
    bias = take(f"{attention}.query_key_value.bias", 3 * c)
    per_head, bias_per_head = weight.reshape(heads, 3, dim, c), bias.reshape(heads, 3, dim)
    state = {}
    for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        rows = order if order is not None and proj != "v_proj" else slice(None)
        state[f"{ours}.self_attn.{proj}.weight"] = per_head[:, part, rows].reshape(c, c)
        state[f"{ours}.self_attn.{proj}.bias"] = bias_per_head[:, part, rows].reshape(c)
    for ours_name, theirs_name, n_out, n_in in (
            ("self_attn.out_proj", f"{attention}.dense", c, c),
            ("ffn.linear1", f"{mlp}.dense_h_to_4h", ff, c),
            ("ffn.linear2", f"{mlp}.dense_4h_to_h", c, ff)):
        state[f"{ours}.{ours_name}.weight"] = take(f"{theirs_name}.weight", n_out, n_in)
        state[f"{ours}.{ours_name}.bias"] = take(f"{theirs_name}.bias", n_out)
    return state


def map_weights(tensors: dict[str, Tensor], config: ModelConfig, hf: dict[str, Any],
                source: Path) -> dict[str, Tensor]:
    """BLOOM's tensors -> our state dict (float32), each key accounted for and each shape
    checked against what the configuration gives."""
    names = unprefixed_names(tensors, "transformer.", source)
    c = config.d_model

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    embedding = take("word_embeddings.weight", config.tgt_vocab_size, c)   # (V, C)
    state = {"decoder.embed.embedding.weight": embedding, "output_proj.weight": embedding}
    norms = {"decoder.embed.norm": "word_embeddings_layernorm", "decoder.final_norm": "ln_f"}
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"h.{i}"
        norms |= {f"{ours}.norm1": f"{theirs}.input_layernorm",
                  f"{ours}.norm3": f"{theirs}.post_attention_layernorm"}
        state.update(megatron_layer(take, config, ours, f"{theirs}.self_attention",
                                    f"{theirs}.mlp"))
    for ours, theirs in norms.items():
        for part in ("weight", "bias"):
            state[f"{ours}.{part}"] = take(f"{theirs}.{part}", c)
    if "lm_head.weight" in names:
        check_tied_copy(tensors, names, source, "lm_head.weight", embedding,
                        "word_embeddings.weight", "BLOOM ties its output to its embeddings")
    refuse_unread(names, source)
    return state
