"""A decoder-only model of Llama's layer with LayerNorms (gain and bias) and rotary
positions (on all or part of each head), no biases but on the query, key and value
projections or none, as transformers' `StableLmForCausalLM`: the inverse of
importers/hf_stablelm.py, each head's query and key rows put back in its order."""

from __future__ import annotations

from torch import Tensor

from transduce.config import ModelConfig
from transduce.export.common import fixed_layout_problems
from transduce.export.hf import HF_ACTIVATIONS, Family
from transduce.export.hf_gpt_neox import in_neox_order
from transduce.model import DecoderOnly

STABLELM = Family("StableLM", "StableLmForCausalLM", "StableLmConfig", "stablelm")
# The fields of ours that StableLM's layers fix.
STABLELM_LAYOUT = {"norm": "layer", "norm_bias": True, "gated_ffn": True, "bias": False,
                   "parallel_residual": False}


def stablelm_problems(c: ModelConfig) -> list[str]:
    """What StableLmForCausalLM cannot hold beyond not_a_plain_transformer's."""
    return fixed_layout_problems(c, STABLELM.name, STABLELM_LAYOUT, HF_ACTIVATIONS)


def stablelm_config(c: ModelConfig) -> dict:
    """StableLmConfig's fields for our layers (the ids and tying are the caller's)."""
    rope = {"rope_type": "linear", "factor": c.rope_factor} if c.rope_scaling == "linear" \
        else {"rope_type": "default"}
    return {"architectures": [STABLELM.model_class], "model_type": STABLELM.model_type,
            "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
            "intermediate_size": c.d_ff, "num_hidden_layers": c.num_decoder_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads,
            "hidden_act": HF_ACTIVATIONS[c.activation],
            "max_position_embeddings": c.max_positions, "layer_norm_eps": c.layer_norm_eps,
            "use_qkv_bias": c.qkv_bias, "qk_layernorm": False,
            "use_parallel_residual": False,
            "rope_parameters": {**rope, "rope_theta": c.rope_base,
                                "partial_rotary_factor": (c.rotary_dims or c.head_dim)
                                / c.head_dim},
            "attention_dropout": c.attention_dropout, "hidden_dropout": c.dropout}


def stablelm_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under StableLmForCausalLM's names."""
    c, decoder = model.config, model.decoder
    state = {"model.embed_tokens.weight": decoder.embed.embedding.weight,
             "lm_head.weight": model.output_proj.weight}

    def put(name: str, module) -> None:
        state[f"{name}.weight"] = module.weight
        if getattr(module, "bias", None) is not None:
            state[f"{name}.bias"] = module.bias

    for i, layer in enumerate(decoder.layers):
        prefix, attn = f"model.layers.{i}", layer.self_attn
        for theirs, projection in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj)):
            weight, bias = in_neox_order(projection, c)
            state[f"{prefix}.self_attn.{theirs}.weight"] = weight
            if bias is not None:
                state[f"{prefix}.self_attn.{theirs}.bias"] = bias
        for theirs, module in (("self_attn.v_proj", attn.v_proj),
                               ("self_attn.o_proj", attn.out_proj),
                               ("mlp.gate_proj", layer.ffn.linear1),
                               ("mlp.up_proj", layer.ffn.linear3),
                               ("mlp.down_proj", layer.ffn.linear2),
                               ("input_layernorm", layer.norm1),
                               ("post_attention_layernorm", layer.norm3)):
            put(f"{prefix}.{theirs}", module)
    put("model.norm", decoder.final_norm)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
