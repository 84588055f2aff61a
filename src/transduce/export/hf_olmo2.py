"""A decoder-only model of OLMo 2's layout (Llama's layer with RMSNorms on the
sub-layers' outputs alone, queries and keys normalized over all heads together) as
transformers' `Olmo2ForCausalLM`: the inverse of importers/hf_olmo2.py."""

from __future__ import annotations

from torch import Tensor

from transduce.config import ModelConfig
from transduce.export.common import fixed_layout_problems
from transduce.export.hf import HF_ACTIVATIONS, Family
from transduce.model import DecoderOnly

OLMO2 = Family("OLMo 2", "Olmo2ForCausalLM", "Olmo2Config", "olmo2")
# The fields of ours that OLMo 2's layers fix.
OLMO2_LAYOUT = {"norm": "rms", "gated_ffn": True, "bias": False, "qkv_bias": False,
                "sandwich_norm": True, "input_norms": False, "qk_norm": True,
                "qk_norm_across_heads": True}


def olmo2_problems(c: ModelConfig) -> list[str]:
    """What Olmo2ForCausalLM cannot hold beyond not_a_plain_transformer's (its rotary
    positions are exported unscaled)."""
    return fixed_layout_problems(c, OLMO2.name, OLMO2_LAYOUT, HF_ACTIVATIONS, ("none",))


def olmo2_config(c: ModelConfig) -> dict:
    """Olmo2Config's fields for our layers (the ids and tying are the caller's)."""
    return {"architectures": [OLMO2.model_class], "model_type": OLMO2.model_type,
            "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
            "intermediate_size": c.d_ff, "num_hidden_layers": c.num_decoder_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads,
            "hidden_act": HF_ACTIVATIONS[c.activation],
            "max_position_embeddings": c.max_positions, "rms_norm_eps": c.layer_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base},
            "attention_bias": False, "attention_dropout": c.attention_dropout}


def olmo2_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under Olmo2ForCausalLM's names."""
    decoder = model.decoder
    state = {"model.embed_tokens.weight": decoder.embed.embedding.weight,
             "model.norm.weight": decoder.final_norm.weight,
             "lm_head.weight": model.output_proj.weight}
    for i, layer in enumerate(decoder.layers):
        prefix, attn = f"model.layers.{i}", layer.self_attn
        for theirs, module in (("self_attn.q_proj", attn.q_proj),
                               ("self_attn.k_proj", attn.k_proj),
                               ("self_attn.v_proj", attn.v_proj),
                               ("self_attn.o_proj", attn.out_proj),
                               ("self_attn.q_norm", attn.q_norm.norm),
                               ("self_attn.k_norm", attn.k_norm.norm),
                               ("mlp.gate_proj", layer.ffn.linear1),
                               ("mlp.up_proj", layer.ffn.linear3),
                               ("mlp.down_proj", layer.ffn.linear2),
                               ("post_attention_layernorm", layer.post_norm1),
                               ("post_feedforward_layernorm", layer.post_norm3)):
            state[f"{prefix}.{theirs}.weight"] = module.weight
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
