"""Hugging Face GPT-J and CodeGen (GPTJForCausalLM, CodeGenForCausalLM or their base
models' directories: GPT-J-6B, CodeGen's mono, multi and nl models, 350M to 16B) -> our
DecoderOnly.

GPT-J is a pre-norm decoder with LayerNorms, GPT-2's tanh GELU and an output of its own,
and four things of its own, each a field of ours:

- parallel residuals over one norm: a layer adds its attention and its feed-forward
  network, both reading the same normalized input, to that input (parallel_residual,
  shared_norm);
- no biases in the attention, biases in the feed-forward network (attention_bias);
- rotary positions on the first rotary_dim features of each head (rotary_dims), turned
  in adjacent pairs (2i, 2i + 1): each head's query and key rows are reordered into our
  pairs (positional.heads_in_rotary_order, interleaved), which leaves every score as it
  was;
- a bias on its output (lm_head.bias: output_bias).

    wte                          decoder.embed.embedding
    h.N.ln_1                     decoder.layers.N.norm1 (the only one)
    h.N.attn.q_proj, k_proj, v_proj   self_attn.*, q and k rows reordered
        (CodeGen: h.N.attn.qkv_proj, in 4 blocks of q, v, k rows: CODEGEN_BLOCKS)
    h.N.attn.out_proj            self_attn.out_proj
    h.N.mlp.fc_in, fc_out        ffn.linear1, ffn.linear2
    ln_f                         decoder.final_norm
    lm_head (weight and bias)    output_proj

The causal-mask buffers older checkpoints saved (attn.bias, attn.masked_bias,
attn.causal_mask) are skipped. The tokenizer (tokenizer.json, or vocab.json + merges.txt
with added_tokens.json) travels with the checkpoint, with <|endoftext|> as bos and eos
where tokenizer_config.json names no others, as GPT-2's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor

from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_foreign_options, refuse_unread, take_weight, unprefixed_names
from transduce.importers.chat_settings import with_chat_settings
from transduce.importers.hf_gpt2 import ACTIVATIONS, HF_CONFIG, _read_json, read_tokenizer
from transduce.importers.hf_llama import check_special_ids, output_projection, \
    required_field, save_import
from transduce.model.positional import heads_in_rotary_order

MODEL_TYPES = ("gptj", "codegen")
# CodeGen's fused projection: the model-parallel shards it was trained with, each a block
# of its queries', values' and keys' rows, in that order.
CODEGEN_BLOCKS = 4
_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias|causal_mask)$")


def import_gptj(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face GPT-J or CodeGen directory (config.json, model.safetensors,
    its shards or pytorch_model.bin, a tokenizer) and write it as our checkpoint at
    `out`, replacing one there; nothing is written unless everything was read and
    checked."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    activation = check_foreign_options(hf, config_file, MODEL_TYPES, {},
                                       "activation_function", "gelu_new", ACTIVATIONS)
    tokenizer = with_chat_settings(read_tokenizer(hf_dir), hf_dir)
    config = model_config(hf, config_file, tokenizer, activation)
    return save_import(hf_dir, out, config, tokenizer, map_weights, "hf-gptj")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """The "gpt2" preset's pre-norm LayerNorm layers with GPT-J's sizes, parallel over
    one norm, bias-free attention, rotary positions on rotary_dim features of each head,
    an output bias and its dropouts."""
    def required(name: str) -> Any:
        return required_field(hf, config_file, name)

    vocab_size, d_model = required("vocab_size"), required("n_embd")
    try:
        config = preset("gpt2", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                        d_model=d_model, num_heads=required("n_head"),
                        d_ff=hf.get("n_inner") or 4 * d_model,
                        num_decoder_layers=required("n_layer"),
                        max_positions=required("n_positions"), positional="rotary",
                        activation=activation, parallel_residual=True, shared_norm=True,
                        attention_bias=False, output_bias=True,
                        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                        dropout=hf.get("resid_pdrop", 0.0),
                        attention_dropout=hf.get("attn_pdrop", 0.0),
                        tie_embeddings="all" if hf.get("tie_word_embeddings", False)
                        else "none", pad_id=tokenizer.pad_id)
        config = config.replace(rotary_dims=_rotary_dims(hf, config_file, config.head_dim))
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    if hf["model_type"] == "codegen":
        if d_model % CODEGEN_BLOCKS:
            raise ForeignCheckpointError(f"{config_file}: n_embd={d_model}: CodeGen's fused "
                                         f"projection needs a multiple of {CODEGEN_BLOCKS}")
        # CodeGen's config.json names bos_token_id 1, a token its tokenizer never adds
        hf = {name: value for name, value in hf.items() if name != "bos_token_id"}
    check_special_ids(hf, config_file, tokenizer, config)
    return config


def _rotary_dims(hf: dict[str, Any], config_file: Path, head_dim: int) -> int | None:
    """rotary_dim (64 where config.json names none, as transformers' default) as our
    rotary_dims: None where it is the whole head."""
    dims = hf.get("rotary_dim", 64)
    if isinstance(dims, bool) or not isinstance(dims, int) or not 0 < dims <= head_dim \
            or dims % 2:
        raise ForeignCheckpointError(f"{config_file}: rotary_dim={dims!r}: must be an even "
                                     f"number of a head's {head_dim} features, above 0")
    return None if dims == head_dim else dims


def map_weights(tensors: dict[str, Tensor], config: ModelConfig,
                source: Path) -> dict[str, Tensor]:
    """GPT-J's or CodeGen's tensors -> our state dict (float32), each key accounted for
    and each shape checked against what the configuration gives; the query and key rows
    in our order of each head's features."""
    names = unprefixed_names(tensors, "transformer.", source)
    c, ff, dim = config.d_model, config.d_ff, config.head_dim

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    def per_head(rows: Tensor) -> Tensor:               # (H * D, C) in our order
        return heads_in_rotary_order(rows, dim, config.rotary_dims, interleaved=True)

    embedding = take("wte.weight", config.tgt_vocab_size, c)   # (V, C)
    state = {"decoder.embed.embedding.weight": embedding}
    fused = "h.0.attn.qkv_proj.weight" in names                  # CodeGen's
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"h.{i}"
        q, k, v = codegen_split(take(f"{theirs}.attn.qkv_proj.weight", 3 * c, c), c) \
            if fused else [take(f"{theirs}.attn.{name}_proj.weight", c, c) for name in "qkv"]
        state |= {f"{ours}.self_attn.q_proj.weight": per_head(q),
                  f"{ours}.self_attn.k_proj.weight": per_head(k),
                  f"{ours}.self_attn.v_proj.weight": v,
                  f"{ours}.self_attn.out_proj.weight": take(f"{theirs}.attn.out_proj.weight",
                                                            c, c)}
        for ours_name, theirs_name, n_out, n_in in (("linear1", "fc_in", ff, c),
                                                    ("linear2", "fc_out", c, ff)):
            state[f"{ours}.ffn.{ours_name}.weight"] = take(f"{theirs}.mlp.{theirs_name}.weight",
                                                           n_out, n_in)
            state[f"{ours}.ffn.{ours_name}.bias"] = take(f"{theirs}.mlp.{theirs_name}.bias",
                                                         n_out)
        for part in ("weight", "bias"):
            state[f"{ours}.norm1.{part}"] = take(f"{theirs}.ln_1.{part}", c)
    for part in ("weight", "bias"):
        state[f"decoder.final_norm.{part}"] = take(f"ln_f.{part}", c)
    state["output_proj.weight"] = output_projection(tensors, names, embedding, config, source,
                                                    "wte.weight")
    state["output_proj.bias"] = take("lm_head.bias", config.tgt_vocab_size)
    refuse_unread(names, source, _IGNORED)
    return state


def codegen_split(qkv: Tensor, d_model: int) -> list[Tensor]:
    """CodeGen's fused rows (3 C, C): CODEGEN_BLOCKS blocks, each of its share of the
    queries', values' and keys' rows -> [q, k, v], each (C, C)."""
    blocks = qkv.reshape(CODEGEN_BLOCKS, 3, d_model // CODEGEN_BLOCKS, d_model)
    query, value, key = (blocks[:, j].reshape(d_model, d_model) for j in range(3))
    return [query, key, value]
