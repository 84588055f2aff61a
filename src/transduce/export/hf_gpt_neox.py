"""A decoder-only model with rotary positions and LayerNorms (pre-norm, biases,
untied or tied output, parallel residuals or not, rotary positions on all or part of
each head) as transformers' `GPTNeoXForCausalLM`: the inverse of
importers/hf_gpt_neox.py, each head's query and key rows put back in GPT-NeoX's order
and q, k, v fused head by head."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transduce.config import ModelConfig
from transduce.export.common import fixed_layout_problems
from transduce.export.hf import Family
from transduce.model import DecoderOnly
from transduce.model.positional import heads_in_rotary_order

GPT_NEOX = Family("GPT-NeoX", "GPTNeoXForCausalLM", "GPTNeoXConfig", "gpt_neox")
# Our activations under transformers' names (hidden_act).
NEOX_ACTIVATIONS = {"gelu": "gelu", "gelu-tanh": "gelu_new", "relu": "relu", "silu": "silu"}
# The fields of ours that GPT-NeoX's layers fix.
NEOX_LAYOUT = {"norm": "layer", "gated_ffn": False, "bias": True, "qkv_bias": False}


def gpt_neox_problems(c: ModelConfig) -> list[str]:
    """What GPTNeoXForCausalLM cannot hold beyond not_a_plain_transformer's."""
    problems = fixed_layout_problems(c, GPT_NEOX.name, NEOX_LAYOUT, NEOX_ACTIVATIONS)
    if c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} (GPT-NeoX has full multi-head "
                        f"attention)")
    return problems


def gpt_neox_config(c: ModelConfig) -> dict:
    """GPTNeoXConfig's fields for our layers (the ids and tying are the caller's)."""
    rope = {"rope_type": "linear", "factor": c.rope_factor} if c.rope_scaling == "linear" \
        else {"rope_type": "default"}
    return {"architectures": [GPT_NEOX.model_class], "model_type": GPT_NEOX.model_type,
            "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
            "intermediate_size": c.d_ff, "num_hidden_layers": c.num_decoder_layers,
            "num_attention_heads": c.num_heads, "hidden_act": NEOX_ACTIVATIONS[c.activation],
            "max_position_embeddings": c.max_positions, "layer_norm_eps": c.layer_norm_eps,
            "use_parallel_residual": c.parallel_residual, "attention_bias": True,
            "rope_parameters": {**rope, "rope_theta": c.rope_base,
                                "partial_rotary_factor": (c.rotary_dims or c.head_dim)
                                / c.head_dim},
            "hidden_dropout": c.dropout, "attention_dropout": c.attention_dropout}


def in_neox_order(projection: nn.Module, config: ModelConfig) -> tuple[Tensor, Tensor | None]:
    """A query or key projection's weight (H * D, C) and bias (H * D), or the norm of
    each head's queries or keys ((D,) and (D,)), with each head's rows in GPT-NeoX's
    order (the rotated features first, pairs (i, i + R/2)), which transformers and
    CTranslate2 rotate: positional.heads_in_rotary_order undone."""
    def theirs(rows: Tensor | None) -> Tensor | None:
        return None if rows is None else \
            heads_in_rotary_order(rows, config.head_dim, config.rotary_dims, to_theirs=True)

    return theirs(projection.weight), theirs(projection.bias)


def gpt_neox_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under GPTNeoXForCausalLM's names."""
    c, decoder = model.config, model.decoder
    heads, dim = c.num_heads, c.head_dim
    state = {"gpt_neox.embed_in.weight": decoder.embed.embedding.weight,
             "lm_head.weight": model.output_proj.weight}   # (saved as embed_out)

    def put(name: str, module) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = module.weight, module.bias

    for i, layer in enumerate(decoder.layers):
        prefix, attn = f"gpt_neox.layers.{i}", layer.self_attn
        parts = [in_neox_order(attn.q_proj, c), in_neox_order(attn.k_proj, c),
                 (attn.v_proj.weight, attn.v_proj.bias)]
        state[f"{prefix}.attention.query_key_value.weight"] = torch.stack(
            [weight.reshape(heads, dim, -1) for weight, _ in parts],
            dim=1).reshape(3 * heads * dim, -1)                  # (H, 3, D, C) -> (3C, C)
        state[f"{prefix}.attention.query_key_value.bias"] = torch.stack(
            [bias.reshape(heads, dim) for _, bias in parts], dim=1).reshape(-1)
        put(f"{prefix}.attention.dense", attn.out_proj)
        put(f"{prefix}.input_layernorm", layer.norm1)
        put(f"{prefix}.post_attention_layernorm", layer.norm3)
        put(f"{prefix}.mlp.dense_h_to_4h", layer.ffn.linear1)
        put(f"{prefix}.mlp.dense_4h_to_h", layer.ffn.linear2)
    put("gpt_neox.final_layer_norm", decoder.final_norm)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
