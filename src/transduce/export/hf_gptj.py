"""A decoder-only model whose layers add a bias-free attention and a feed-forward network
over one norm (shared_norm, attention_bias False), with LayerNorms and rotary positions
(on all or part of each head), as transformers' `GPTJForCausalLM`: the inverse of
importers/hf_gptj.py, each head's query and key rows put back in GPT-J's adjacent pairs.
GPT-J's output always has a bias: a model without one (output_bias False) writes zeros.
A CodeGen import exports as GPT-J too: the same layers, q, k and v stored apart."""

from __future__ import annotations

from torch import Tensor

from transduce.config import ModelConfig
from transduce.export.common import fixed_layout_problems
from transduce.export.hf import Family
from transduce.export.hf_gpt_neox import NEOX_ACTIVATIONS
from transduce.export.hf_phi import lm_head_with_bias
from transduce.model import DecoderOnly
from transduce.model.positional import heads_in_rotary_order

GPTJ = Family("GPT-J", "GPTJForCausalLM", "GPTJConfig", "gptj")
# The fields of ours that GPT-J's layers fix (its rotary base is 10,000, unscaled).
GPTJ_LAYOUT = {"norm": "layer", "gated_ffn": False, "bias": True, "attention_bias": False,
               "qkv_bias": False, "parallel_residual": True, "shared_norm": True,
               "rope_base": 10000.0}


def gptj_problems(c: ModelConfig) -> list[str]:
    """What GPTJForCausalLM cannot hold beyond not_a_plain_transformer's."""
    problems = fixed_layout_problems(c, GPTJ.name, GPTJ_LAYOUT, NEOX_ACTIVATIONS,
                                     scalings=("none",))
    if c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} (GPT-J has full multi-head "
                        f"attention)")
    return problems


def gptj_config(c: ModelConfig) -> dict:
    """GPTJConfig's fields for our layers (the ids and tying are the caller's)."""
    return {"architectures": [GPTJ.model_class], "model_type": GPTJ.model_type,
            "vocab_size": c.tgt_vocab_size, "n_embd": c.d_model, "n_inner": c.d_ff,
            "n_layer": c.num_decoder_layers, "n_head": c.num_heads,
            "rotary_dim": c.rotary_dims or c.head_dim, "n_positions": c.max_positions,
            "activation_function": NEOX_ACTIVATIONS[c.activation],
            "layer_norm_epsilon": c.layer_norm_eps, "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout, "attn_pdrop": c.attention_dropout}


def gptj_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under GPTJForCausalLM's names."""
    c, decoder = model.config, model.decoder
    state = {"transformer.wte.weight": decoder.embed.embedding.weight,
             **lm_head_with_bias(model)}

    def put(name: str, module, parts=("weight", "bias")) -> None:
        state.update({f"{name}.{part}": getattr(module, part) for part in parts})

    for i, layer in enumerate(decoder.layers):
        prefix, attn = f"transformer.h.{i}", layer.self_attn
        for theirs, projection in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj)):
            state[f"{prefix}.attn.{theirs}.weight"] = heads_in_rotary_order(
                projection.weight, c.head_dim, c.rotary_dims, to_theirs=True, interleaved=True)
        put(f"{prefix}.attn.v_proj", attn.v_proj, ("weight",))
        put(f"{prefix}.attn.out_proj", attn.out_proj, ("weight",))
        put(f"{prefix}.mlp.fc_in", layer.ffn.linear1)
        put(f"{prefix}.mlp.fc_out", layer.ffn.linear2)
        put(f"{prefix}.ln_1", layer.norm1)
    put("transformer.ln_f", decoder.final_norm)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
