"""Hugging Face OLMo 2 (Olmo2ForCausalLM directories: OLMo-2-0425-1B, OLMo-2-1124-7B
and 13B, OLMo-2-0325-32B, their SFT, DPO and Instruct twins) -> our DecoderOnly.

OLMo 2 is Llama's layer (SwiGLU, rotary positions, RMSNorm, no biases, grouped-query
attention) with two changes, each a field of ours:

- its sub-layers read the residual stream as it is and only their outputs are
  normalized before the sum, x + Norm(Attn(x)) (sandwich_norm with input_norms False);
- its queries and keys are normalized over all heads together, one RMSNorm of the
  whole projection (qk_norm with qk_norm_across_heads).

    embed_tokens                           decoder.embed.embedding
    layers.N.self_attn.q_proj, k_proj, v_proj, o_proj   self_attn.*
    layers.N.self_attn.q_norm, k_norm      self_attn.q_norm.norm, k_norm.norm
    layers.N.post_attention_layernorm      post_norm1 (on the attention's output)
    layers.N.mlp.gate_proj, up_proj, down_proj   ffn.linear1, linear3, linear2
    layers.N.post_feedforward_layernorm    post_norm3
    norm                                   decoder.final_norm
    lm_head                                output_proj (tied or not)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from transduce.config import ModelConfig
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import refuse_unread, take_weight, unprefixed_names
from transduce.importers.hf_gpt2 import END_OF_TEXT
from transduce.importers.hf_llama import ACTIVATIONS, import_decoder, layer_weights, \
    llama_layer_config, output_projection, rope_fields

MODEL_TYPES = ("olmo2",)
# Options whose other value changes what the model computes: name -> the value we have.
FIXED_OPTIONS = {"attention_bias": False}
SPECIALS = {"bos": END_OF_TEXT, "eos": END_OF_TEXT, "pad": None}


def import_olmo2(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face OLMo 2 directory (config.json, model.safetensors, its shards
    or pytorch_model.bin, tokenizer.json) and write it as our checkpoint at `out`,
    replacing one there; nothing is written unless everything was read and checked."""
    return import_decoder(hf_dir, out, MODEL_TYPES, FIXED_OPTIONS, ("silu", ACTIVATIONS),
                          SPECIALS, model_config, map_weights, "hf-olmo2")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 activation: str) -> ModelConfig:
    """The "llama-small" preset with OLMo 2's sizes and its two kinds of norm."""
    return llama_layer_config(hf, config_file, tokenizer, activation,
                              **rope_fields(hf, config_file),
                              layer_norm_eps=hf.get("rms_norm_eps", 1e-5), sandwich_norm=True,
                              input_norms=False, qk_norm=True, qk_norm_across_heads=True)


def map_weights(tensors: dict[str, Tensor], config: ModelConfig,
                source: Path) -> dict[str, Tensor]:
    """OLMo 2's tensors -> our state dict (float32), each key accounted for and each
    shape checked against what the configuration gives."""
    names = unprefixed_names(tensors, "model.", source)
    c, dim = config.d_model, config.head_dim

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    embedding = take("embed_tokens.weight", config.tgt_vocab_size, c)   # (V, C)
    state = {"decoder.embed.embedding.weight": embedding,
             "decoder.final_norm.weight": take("norm.weight", c)}
    per_head = config.replace(qk_norm=False, qk_norm_across_heads=False)  # (its norms below)
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"layers.{i}"
        state.update(layer_weights(take, per_head, ours, theirs))
        for name, heads in (("q_norm", config.num_heads), ("k_norm", config.kv_heads)):
            state[f"{ours}.self_attn.{name}.norm.weight"] = take(
                f"{theirs}.self_attn.{name}.weight", heads * dim)
        for norm, theirs_norm in (("post_norm1", "post_attention_layernorm"),
                                  ("post_norm3", "post_feedforward_layernorm")):
            state[f"{ours}.{norm}.weight"] = take(f"{theirs}.{theirs_norm}.weight", c)
    state["output_proj.weight"] = output_projection(tensors, names, embedding, config, source)
    refuse_unread(names, source)
    return state
