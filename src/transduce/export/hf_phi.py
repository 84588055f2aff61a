"""A decoder-only model whose layers add their attention and feed-forward network over
one norm (shared_norm), with LayerNorms, biases and rotary positions (on all or part of
each head), as transformers' `PhiForCausalLM`: the inverse of importers/hf_phi.py, each
head's query and key rows (and their norms, qk_norm) put back in Phi's order. Phi's
output always has a bias: a model without one (output_bias False) writes zeros."""

from __future__ import annotations

from torch import Tensor

from transduce.config import ModelConfig
from transduce.export.common import fixed_layout_problems
from transduce.export.hf import Family
from transduce.export.hf_gpt_neox import NEOX_ACTIVATIONS, in_neox_order
from transduce.model import DecoderOnly

PHI = Family("Phi", "PhiForCausalLM", "PhiConfig", "phi")
# The fields of ours that Phi's layers fix.
PHI_LAYOUT = {"norm": "layer", "gated_ffn": False, "bias": True, "qkv_bias": False,
              "parallel_residual": True, "shared_norm": True}


def phi_problems(c: ModelConfig) -> list[str]:
    """What PhiForCausalLM cannot hold beyond not_a_plain_transformer's."""
    return fixed_layout_problems(c, PHI.name, PHI_LAYOUT, NEOX_ACTIVATIONS)


def phi_config(c: ModelConfig) -> dict:
    """PhiConfig's fields for our layers (the ids and tying are the caller's)."""
    rope = {"rope_type": "linear", "factor": c.rope_factor} if c.rope_scaling == "linear" \
        else {"rope_type": "default"}
    fraction = (c.rotary_dims or c.head_dim) / c.head_dim
    return {"architectures": [PHI.model_class], "model_type": PHI.model_type,
            "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
            "intermediate_size": c.d_ff, "num_hidden_layers": c.num_decoder_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads,
            "hidden_act": NEOX_ACTIVATIONS[c.activation],
            "max_position_embeddings": c.max_positions, "layer_norm_eps": c.layer_norm_eps,
            "qk_layernorm": c.qk_norm,
            "rope_parameters": {**rope, "rope_theta": c.rope_base,
                                "partial_rotary_factor": fraction},
            "partial_rotary_factor": fraction,          # (transformers 4's name)
            "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
            "attention_dropout": c.attention_dropout}


def lm_head_with_bias(model: DecoderOnly) -> dict[str, Tensor]:
    """The output projection as an lm_head that always has a bias (Phi's, GPT-J's):
    zeros for a model without one."""
    output = model.output_proj
    bias = output.bias if output.bias is not None else \
        output.weight.new_zeros(model.config.tgt_vocab_size)
    return {"lm_head.weight": output.weight, "lm_head.bias": bias}


def phi_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under PhiForCausalLM's names."""
    c, decoder = model.config, model.decoder
    state = {"model.embed_tokens.weight": decoder.embed.embedding.weight,
             **lm_head_with_bias(model)}

    def put(name: str, module) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = module.weight, module.bias

    for i, layer in enumerate(decoder.layers):
        prefix, attn = f"model.layers.{i}", layer.self_attn
        norms = (("q_layernorm", attn.q_norm), ("k_layernorm", attn.k_norm)) \
            if c.qk_norm else ()
        for theirs, module in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj), *norms):
            state[f"{prefix}.self_attn.{theirs}.weight"], \
                state[f"{prefix}.self_attn.{theirs}.bias"] = in_neox_order(module, c)
        for theirs, module in (("self_attn.v_proj", attn.v_proj),
                               ("self_attn.dense", attn.out_proj),
                               ("mlp.fc1", layer.ffn.linear1), ("mlp.fc2", layer.ffn.linear2),
                               ("input_layernorm", layer.norm1)):
            put(f"{prefix}.{theirs}", module)
    put("model.final_layernorm", decoder.final_norm)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
