"""A decoder-only model of Llama's layer with LayerNorms (gain and bias) and rotary
positions (on all or part of each head), no biases but on the query, key and value
projections or none, as transformers' `StableLmForCausalLM`: the inverse of
importers/hf_stablelm.py, each head's query and key rows put back in its order. StableLM
2 12B's parallel layers over one norm and norms of each head's queries and keys
(use_parallel_residual, qk_layernorm) hold ours of shared_norm and qk_norm_per_head."""

from __future__ import annotations

from torch import Tensor, nn

from transduce.config import ModelConfig
from transduce.export.common import fixed_layout_problems
from transduce.export.hf import HF_ACTIVATIONS, Family
from transduce.export.hf_gpt_neox import in_neox_order
from transduce.model import DecoderOnly
from transduce.model.positional import heads_in_rotary_order

STABLELM = Family("StableLM", "StableLmForCausalLM", "StableLmConfig", "stablelm")
# The fields of ours that StableLM's layers fix.
STABLELM_LAYOUT = {"norm": "layer", "norm_bias": True, "gated_ffn": True, "bias": False,
                   "output_bias": False}


def stablelm_problems(c: ModelConfig) -> list[str]:
    """What StableLmForCausalLM cannot hold beyond not_a_plain_transformer's: its
    parallel layers share one norm, its norms of the queries and keys have a gain per
    head."""
    problems = fixed_layout_problems(c, STABLELM.name, STABLELM_LAYOUT, HF_ACTIVATIONS)
    if c.parallel_residual != c.shared_norm:
        problems.append(f"parallel_residual={c.parallel_residual} with shared_norm="
                        f"{c.shared_norm} (StableLM's parallel layers, and only they, read "
                        f"one norm)")
    if c.qk_norm and not c.qk_norm_per_head:
        problems.append("qk_norm=True without qk_norm_per_head (StableLM's norms of the "
                        "queries and keys have a gain per head)")
    return problems


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
            "use_qkv_bias": c.qkv_bias, "qk_layernorm": c.qk_norm_per_head,
            "use_parallel_residual": c.parallel_residual,
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
        if c.qk_norm_per_head:              # a gain per head, in its order
            for theirs, norm in (("q_layernorm", attn.q_norm), ("k_layernorm", attn.k_norm)):
                gains = heads_in_rotary_order(norm.weight.reshape(-1), c.head_dim,
                                              c.rotary_dims, to_theirs=True)
                for h, gain in enumerate(gains.view_as(norm.weight)):
                    state[f"{prefix}.self_attn.{theirs}.norms.{h}.weight"] = gain
        for theirs, module in (("self_attn.v_proj", attn.v_proj),
                               ("self_attn.o_proj", attn.out_proj),
                               ("mlp.gate_proj", layer.ffn.linear1),
                               ("mlp.up_proj", layer.ffn.linear3),
                               ("mlp.down_proj", layer.ffn.linear2),
                               ("input_layernorm", layer.norm1),
                               ("post_attention_layernorm", layer.norm3)):
            if not isinstance(module, nn.Identity):      # (a shared norm's missing norm3)
                put(f"{prefix}.{theirs}", module)
    put("model.norm", decoder.final_norm)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
