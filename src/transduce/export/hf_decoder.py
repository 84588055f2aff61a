"""Export a decoder-only model to Hugging Face transformers: Llama's layout (rotary
positions, RMSNorm, SwiGLU, grouped-query attention, no biases) as `LlamaForCausalLM`,
as `MistralForCausalLM` with sliding-window attention, as `Qwen2ForCausalLM` with
biases on the query, key and value projections (qkv_bias), as `Qwen3ForCausalLM`
with each head's queries and keys normalized (qk_norm; the Qwens' window on some layers
or all), as `Gemma3ForCausalLM` with sandwich norms (and qk_norm, scaled embeddings,
sliding layers among full ones), or as `Gemma2ForCausalLM` with sandwich norms but no
qk_norm (and soft-capped scores and logits, one rotary base); GPT-2's (learned
positions, LayerNorm, biases) as `GPT2LMHeadModel`, with ALiBi and a norm of the
embeddings in place of the positions as `BloomForCausalLM`, and with rotary positions
(on all or part of each head; parallel residuals or not) as `GPTNeoXForCausalLM`
(hf_gpt_neox.py), with parallel residuals over one norm and an output bias as
`PhiForCausalLM` (hf_phi.py), and with bias-free attention besides as `GPTJForCausalLM`
(hf_gptj.py), Llama's layer with LayerNorms as `StableLmForCausalLM`
(hf_stablelm.py), and with norms on the sub-layers' outputs alone as `Olmo2ForCausalLM`
(hf_olmo2.py).

They hold our layers as they are, so the weights only change names (GPT-2's Conv1D
stores each matrix transposed, and fuses q, k, v; BLOOM fuses them head by head;
Gemma's norms multiply by 1 + w).
The tokenizer goes with them as a tokenizer.json that gives our ids: an imported
model's own, or our SentencePiece model written out in Llama 2's tokenizer layout
(data/hf_tokenizer.py), which starts every sequence with bos as our language models are
trained.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from transduce import checkpoint
from transduce.config import ModelConfig
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.hf import HF_ACTIVATIONS, Family, generation_config, \
    save_with_tokenizer_json
from transduce.export.hf_gpt_neox import GPT_NEOX, gpt_neox_config, gpt_neox_problems, \
    gpt_neox_state_dict
from transduce.export.hf_gptj import GPTJ, gptj_config, gptj_problems, gptj_state_dict
from transduce.export.hf_olmo2 import OLMO2, olmo2_config, olmo2_problems, olmo2_state_dict
from transduce.export.hf_phi import PHI, phi_config, phi_problems, phi_state_dict
from transduce.export.hf_stablelm import STABLELM, stablelm_config, stablelm_problems, \
    stablelm_state_dict
from transduce.importers.peft_layout import is_gpt_neox_layout, neox_family
from transduce.model import DecoderOnly

LLAMA = Family("Llama", "LlamaForCausalLM", "LlamaConfig", "llama")
QWEN2 = Family("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", "qwen2")
QWEN3 = Family("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", "qwen3")
MISTRAL = Family("Mistral", "MistralForCausalLM", "MistralConfig", "mistral")
GEMMA3 = Family("Gemma 3", "Gemma3ForCausalLM", "Gemma3TextConfig", "gemma3_text")
GEMMA2 = Family("Gemma 2", "Gemma2ForCausalLM", "Gemma2Config", "gemma2")
GEMMAS = (GEMMA2, GEMMA3)
GPT2 = Family("GPT-2", "GPT2LMHeadModel", "GPT2Config", "gpt2")
BLOOM = Family("BLOOM", "BloomForCausalLM", "BloomConfig", "bloom")
# Our activations under GPT-2's names (its activation_function).
GPT2_ACTIVATIONS = {"gelu-tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def decoder_family(config: ModelConfig) -> Family:
    """Llama for rotary positions (Gemma 3 with sandwich norms and norms of the queries
    and keys or two rotary bases, Gemma 2 with sandwich norms alone, Qwen3 with norms of
    the queries and keys, Qwen2 with biases on q, k, v alone, Mistral with a sliding
    window), GPT-NeoX for rotary positions with LayerNorms (or on part of each head, or
    parallel residuals; StableLM with gated feed-forward networks; Phi with parallel
    residuals over one norm, or an output bias; GPT-J with bias-free attention), OLMo 2
    for norms on the sub-layers' outputs alone or of the queries and keys over all
    heads, BLOOM for ALiBi, GPT-2 for the rest."""
    if config.positional == "alibi":
        return BLOOM
    if config.positional != "rotary":
        return GPT2
    if is_gpt_neox_layout(config):
        return {"gptj": GPTJ, "phi": PHI, "stablelm": STABLELM,
                "gpt_neox": GPT_NEOX}[neox_family(config)]
    if not config.input_norms or config.qk_norm_across_heads:
        return OLMO2
    if config.sandwich_norm:
        return GEMMA3 if config.qk_norm or config.local_rope_base is not None else GEMMA2
    if config.qk_norm:
        return QWEN3
    if config.qkv_bias and not config.bias:
        return QWEN2
    return MISTRAL if config.attention_type == "sliding" else LLAMA


def check_decoder_exportable(model: DecoderOnly) -> None:
    c = model.config
    family = decoder_family(c)
    problems = not_a_plain_transformer(c, arch="decoder",
                                       sliding=family in (MISTRAL, QWEN2, QWEN3, *GEMMAS),
                                       any_head_size=family is not GPT2,   # head_dim
                                       qk_norm=family in (QWEN3, GEMMA3, OLMO2, PHI,
                                                          STABLELM),
                                       mixed=family in (QWEN2, QWEN3),
                                       gemma=family in (*GEMMAS, OLMO2),   # sandwich norms
                                       softcap=family in GEMMAS,
                                       score_bias=("alibi",) if family is BLOOM else (),
                                       embedding_norm=family is BLOOM,
                                       neox=family in (GPT_NEOX, STABLELM, PHI, GPTJ),
                                       olmo2=family is OLMO2,
                                       phi=family in (PHI, GPTJ, STABLELM),   # shared_norm
                                       attention_bias=family is GPTJ,
                                       qk_norm_per_head=family is STABLELM)
    if family in (GPT_NEOX, STABLELM, OLMO2, PHI, GPTJ):   # their layouts: hf_phi.py, ...
        problems += {GPT_NEOX: gpt_neox_problems, STABLELM: stablelm_problems,
                     OLMO2: olmo2_problems, PHI: phi_problems, GPTJ: gptj_problems}[family](c)
        if problems:
            raise ExportError(f"cannot export to {family.name}: " + "; ".join(problems))
        return
    if c.scale_embeddings and family not in GEMMAS:
        problems.append("scale_embeddings=True (the format does not scale embeddings)")
    if family is QWEN3 and c.qkv_bias:
        problems.append("qkv_bias=True (Qwen3's attention_bias puts one on the output "
                        "projection too)")
    if not c.norm_first:
        problems.append("norm_first=False (the format's layers are pre-norm)")
    gemma = {"qk_norm": family is GEMMA3, "scale_embeddings": True, "qkv_bias": False} \
        if family in GEMMAS else {}
    wanted = {"norm": "rms", "gated_ffn": True, "bias": False, **gemma} \
        if family not in (GPT2, BLOOM) else \
        {"positional": "learned", "norm": "layer", "gated_ffn": False, "bias": True,
         "tie_embeddings": c.tie_embeddings if c.tie_embeddings != "none" else "all"}
    if family is BLOOM:       # its feed-forward is 4 d_model wide, its output tied
        wanted |= {"positional": "alibi", "embedding_norm": True, "d_ff": 4 * c.d_model,
                   "tie_embeddings": "all", "activation": "gelu-tanh"}
    problems += [f"{name}={getattr(c, name)!r} (the format's is {value!r})"
                 for name, value in wanted.items() if getattr(c, name) != value]
    activations = GPT2_ACTIVATIONS if family in (GPT2, BLOOM) else HF_ACTIVATIONS
    if c.activation not in activations:
        problems.append(f"activation={c.activation!r} (not one of {sorted(activations)})")
    if family in (GPT2, BLOOM) and c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} ({family.name} has full multi-head "
                        f"attention; rotary positions export as Llama, which groups heads)")
    if family is BLOOM and c.head_size is not None and c.head_size * c.num_heads != c.d_model:
        problems.append(f"head_size={c.head_size} (BLOOM's heads are d_model / num_heads "
                        f"wide)")
    if problems:
        raise ExportError(f"cannot export to {family.name}: " + "; ".join(problems))


def qwen_window(c: ModelConfig) -> dict:
    """Qwen2's and Qwen3's window fields: whether there is one, its size (counting the
    query's own key), each layer's kind (layer_types, which transformers 5 reads) and
    max_window_layers, the layers before the first sliding one, which attend over
    everything (what transformers 4 reads alone: exact where the full layers come
    first, as Qwen's own do)."""
    sliding = c.attention_type == "sliding"
    kinds = ["sliding_attention" if sliding and c.layer_attention_type(i) == "sliding"
             else "full_attention" for i in range(c.num_decoder_layers)]
    first = kinds.index("sliding_attention") if sliding else c.num_decoder_layers
    return {"use_sliding_window": sliding,
            "sliding_window": c.attention_window + 1 if sliding else None,
            "max_window_layers": first, "layer_types": kinds}


def hf_decoder_config(model: DecoderOnly, tokenizer) -> dict:
    """The config of the transformers model that holds this one (decoder_family)."""
    c = model.config
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id, "tie_word_embeddings": c.tie_embeddings != "none"}
    family = decoder_family(c)
    if family in GEMMAS:
        return {**gemma_config(c, family), **ids}
    if family is GPT_NEOX:
        return {**gpt_neox_config(c), **ids}
    if family is STABLELM:
        return {**stablelm_config(c), **ids}
    if family is OLMO2:
        return {**olmo2_config(c), **ids}
    if family is PHI:
        return {**phi_config(c), **ids}
    if family is GPTJ:
        return {**gptj_config(c), **ids}
    if family is BLOOM:
        return {"architectures": [BLOOM.model_class], "model_type": BLOOM.model_type,
                "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
                "n_layer": c.num_decoder_layers, "n_head": c.num_heads,
                "layer_norm_epsilon": c.layer_norm_eps, "hidden_dropout": c.dropout,
                "attention_dropout": c.attention_dropout, "seq_length": c.max_positions,
                "apply_residual_connection_post_layernorm": False, **ids}
    if family is not GPT2:
        # Mistral's window counts the query's own key; ours, the keys before it.
        layout = {LLAMA: {"attention_bias": False, "mlp_bias": False},
                  MISTRAL: {"sliding_window": c.attention_window + 1},
                  QWEN2: qwen_window(c),
                  QWEN3: {"attention_bias": False, **qwen_window(c)}}[family]
        return {"architectures": [family.model_class], "model_type": family.model_type,
                "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
                "intermediate_size": c.d_ff, "num_hidden_layers": c.num_decoder_layers,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads,
                "head_dim": c.head_dim, "hidden_act": HF_ACTIVATIONS[c.activation],
                "max_position_embeddings": c.max_positions, "rms_norm_eps": c.layer_norm_eps,
                # the rotary base and scaling as transformers 5 (rope_parameters) and 4
                # (rope_theta, rope_scaling) read them
                "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base,
                                    **hf_rope_scaling(c)},
                "rope_theta": c.rope_base, "rope_scaling": hf_rope_scaling(c) or None,
                "attention_dropout": c.attention_dropout,
                **layout, **ids}
    return {"architectures": [GPT2.model_class], "model_type": GPT2.model_type,
            "vocab_size": c.tgt_vocab_size, "n_embd": c.d_model, "n_inner": c.d_ff,
            "n_layer": c.num_decoder_layers, "n_head": c.num_heads,
            "n_positions": c.max_positions, "activation_function": GPT2_ACTIVATIONS[c.activation],
            "layer_norm_epsilon": c.layer_norm_eps, "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout, "attn_pdrop": c.attention_dropout, **ids}


def gemma_config(c: ModelConfig, family: Family) -> dict:
    """Gemma3TextConfig's or Gemma2Config's fields for our layers: each layer's kind
    (layer_types), the window with the query's own key counted, each kind's rotary
    positions (Gemma 2's one for all), queries scaled by 1/sqrt(head_dim), the scores'
    and logits' soft caps."""
    kinds = ["sliding_attention" if c.layer_attention_type(i) == "sliding" else
             "full_attention" for i in range(c.num_decoder_layers)]
    full = {"rope_type": "default", "rope_theta": c.rope_base, **hf_rope_scaling(c)}
    local = full if c.local_rope_base is None else \
        {"rope_type": "default", "rope_theta": c.local_rope_base}
    rope = full if family is GEMMA2 else {"full_attention": full, "sliding_attention": local}
    return {"architectures": [family.model_class], "model_type": family.model_type,
            "vocab_size": c.tgt_vocab_size, "hidden_size": c.d_model,
            "intermediate_size": c.d_ff, "num_hidden_layers": c.num_decoder_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads,
            "head_dim": c.head_dim, "query_pre_attn_scalar": c.head_dim,
            "hidden_activation": HF_ACTIVATIONS[c.activation],
            "max_position_embeddings": c.max_positions, "rms_norm_eps": c.layer_norm_eps,
            "layer_types": kinds, "sliding_window": c.attention_window + 1,
            "rope_parameters": rope, "attention_bias": False,
            "attention_dropout": c.attention_dropout,
            "attn_logit_softcapping": c.attention_softcap,
            "final_logit_softcapping": c.logit_softcap}


def hf_rope_scaling(c: ModelConfig) -> dict:
    """ModelConfig's rotary scaling under transformers' names (rope_type "default": none)."""
    if c.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": c.rope_factor}
    if c.rope_scaling == "llama3":
        return {"rope_type": "llama3", "factor": c.rope_factor,
                "low_freq_factor": c.rope_low_freq_factor,
                "high_freq_factor": c.rope_high_freq_factor,
                "original_max_position_embeddings": c.rope_original_positions}
    return {}


def llama_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under LlamaForCausalLM's (and Qwen2's, Qwen3's) names, the inverse of
    importers/hf_llama.py."""
    decoder = model.decoder
    state = {"model.embed_tokens.weight": decoder.embed.embedding.weight,
             "model.norm.weight": decoder.final_norm.weight,
             "lm_head.weight": model.output_proj.weight}
    for i, layer in enumerate(decoder.layers):
        prefix = f"model.layers.{i}"
        for theirs, ours in (("self_attn.q_proj", layer.self_attn.q_proj),
                             ("self_attn.k_proj", layer.self_attn.k_proj),
                             ("self_attn.v_proj", layer.self_attn.v_proj),
                             ("self_attn.o_proj", layer.self_attn.out_proj),
                             ("mlp.gate_proj", layer.ffn.linear1),
                             ("mlp.up_proj", layer.ffn.linear3),
                             ("mlp.down_proj", layer.ffn.linear2),
                             ("input_layernorm", layer.norm1),
                             ("post_attention_layernorm", layer.norm3)):
            state[f"{prefix}.{theirs}.weight"] = ours.weight
            if getattr(ours, "bias", None) is not None:           # Qwen2's q, k, v
                state[f"{prefix}.{theirs}.bias"] = ours.bias
        if layer.self_attn.q_norm is not None:                    # Qwen3's
            state[f"{prefix}.self_attn.q_norm.weight"] = layer.self_attn.q_norm.weight
            state[f"{prefix}.self_attn.k_norm.weight"] = layer.self_attn.k_norm.weight
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def gemma_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under Gemma3ForCausalLM's (and Gemma2's) names, every norm's w as
    w - 1 (Gemma's norms multiply by 1 + w): the inverse of importers/hf_gemma.py."""
    state = llama_state_dict(model)
    for i, layer in enumerate(model.decoder.layers):
        prefix = f"model.layers.{i}"
        state[f"{prefix}.pre_feedforward_layernorm.weight"] = \
            state.pop(f"{prefix}.post_attention_layernorm.weight")
        state[f"{prefix}.post_attention_layernorm.weight"] = layer.post_norm1.weight
        state[f"{prefix}.post_feedforward_layernorm.weight"] = layer.post_norm3.weight
    return {name: tensor.detach() - 1.0 if name.endswith("norm.weight") else
            tensor.detach().clone().contiguous() for name, tensor in state.items()}


def gpt2_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under GPT2LMHeadModel's names: Conv1D matrices are (in, out), the
    transpose of nn.Linear's, and q, k, v are one c_attn (the inverse of hf_gpt2.py)."""
    decoder = model.decoder
    state = {"transformer.wte.weight": decoder.embed.embedding.weight,
             "transformer.wpe.weight": decoder.embed.positions.embedding.weight,
             "lm_head.weight": model.output_proj.weight}

    def norm(name: str, layer_norm) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = layer_norm.weight, layer_norm.bias

    def conv1d(name: str, *linears) -> None:
        state[f"{name}.weight"] = torch.cat([linear.weight for linear in linears]).t()
        state[f"{name}.bias"] = torch.cat([linear.bias for linear in linears])

    for i, layer in enumerate(decoder.layers):
        prefix, attn = f"transformer.h.{i}", layer.self_attn
        norm(f"{prefix}.ln_1", layer.norm1)
        norm(f"{prefix}.ln_2", layer.norm3)
        conv1d(f"{prefix}.attn.c_attn", attn.q_proj, attn.k_proj, attn.v_proj)
        conv1d(f"{prefix}.attn.c_proj", attn.out_proj)
        conv1d(f"{prefix}.mlp.c_fc", layer.ffn.linear1)
        conv1d(f"{prefix}.mlp.c_proj", layer.ffn.linear2)
    norm("transformer.ln_f", decoder.final_norm)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def bloom_state_dict(model: DecoderOnly) -> dict[str, Tensor]:
    """Our weights under BloomForCausalLM's names: q, k and v fused head by head, each
    head's rows together (the inverse of importers/hf_bloom.py)."""
    decoder, heads = model.decoder, model.config.num_heads
    state = {"transformer.word_embeddings.weight": decoder.embed.embedding.weight,
             "lm_head.weight": model.output_proj.weight}

    def norm(name: str, layer_norm) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = layer_norm.weight, layer_norm.bias

    def linear(name: str, layer) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = layer.weight, layer.bias

    norm("transformer.word_embeddings_layernorm", decoder.embed.norm)
    for i, layer in enumerate(decoder.layers):
        prefix, attn = f"transformer.h.{i}", layer.self_attn
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        state[f"{prefix}.self_attention.query_key_value.weight"] = torch.stack(
            [part.weight.reshape(heads, -1, part.weight.shape[1]) for part in parts],
            dim=1).reshape(-1, parts[0].weight.shape[1])         # (H, 3, D, C) -> (3C, C)
        state[f"{prefix}.self_attention.query_key_value.bias"] = torch.stack(
            [part.bias.reshape(heads, -1) for part in parts], dim=1).reshape(-1)
        norm(f"{prefix}.input_layernorm", layer.norm1)
        norm(f"{prefix}.post_attention_layernorm", layer.norm3)
        linear(f"{prefix}.self_attention.dense", attn.out_proj)
        linear(f"{prefix}.mlp.dense_h_to_4h", layer.ffn.linear1)
        linear(f"{prefix}.mlp.dense_4h_to_h", layer.ffn.linear2)
    norm("transformer.ln_f", decoder.final_norm)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def hf_decoder_model(model: DecoderOnly, tokenizer):
    """A transformers model holding our weights (in eval mode); the model was checked
    (check_decoder_exportable) by export_hf_decoder, before its vocabulary."""
    import transformers

    family = decoder_family(model.config)
    config = getattr(transformers, family.config_class)(**hf_decoder_config(model, tokenizer))
    theirs = getattr(transformers, family.model_class)(config).eval()
    state = {GPT2: gpt2_state_dict, BLOOM: bloom_state_dict, GEMMA3: gemma_state_dict,
             GEMMA2: gemma_state_dict, GPT_NEOX: gpt_neox_state_dict,
             STABLELM: stablelm_state_dict, OLMO2: olmo2_state_dict,
             PHI: phi_state_dict, GPTJ: gptj_state_dict}.get(
        family, llama_state_dict)(model)
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    left = [name for name in missing if not name.endswith((".attn.bias", ".attn.masked_bias"))]
    if left or unexpected:
        raise ExportError(f"{family.name} weights not set: {left[:5]}; unknown: "
                          f"{unexpected[:5]}")
    theirs.generation_config = generation_config(theirs.config, model.config.max_positions)
    theirs.generation_config.update(num_beams=1, length_penalty=1.0, early_stopping=False)
    if getattr(tokenizer, "stop_ids", ()):         # an instruct model's other end tokens
        theirs.generation_config.eos_token_id = [tokenizer.eos_id, *tokenizer.stop_ids]
    return theirs


def hf_tokenizer(directory: Path, family: Family):
    """The checkpoint's tokenizer as a tokenizer.json backend: an imported model's own,
    or our SentencePiece model written out (HFTokenizer.from_sentencepiece). Not for
    Qwen2 and Qwen3: transformers reads their tokenizer.json through Qwen2Tokenizer,
    whose own pre-tokenizer would split our pieces' text differently."""
    tokenizer = checkpoint.load_tokenizer(directory)
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer
    if family in (QWEN2, QWEN3):
        why = "qkv_bias=True without bias is Qwen2's layout; a Llama has no biases" \
            if family is QWEN2 else "qk_norm=True is Qwen3's layout; a Llama has no such norms"
        raise ExportError(f"cannot export to {family.name} with a SentencePiece vocabulary: "
                          f"transformers reads a {family.model_type} model's tokenizer as "
                          f"Qwen2Tokenizer, whose pre-tokenizer would give other ids ({why})")
    return HFTokenizer.from_sentencepiece(tokenizer)


def export_hf_decoder(directory: Path, model: DecoderOnly, out: Path) -> Path:
    """Write the checkpoint at `directory`, whose model is `model`, as OUT/ with
    config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and our export marker; loadable with transformers'
    AutoModelForCausalLM and AutoTokenizer -> OUT."""
    check_decoder_exportable(model)          # the layers' problems before the vocabulary's
    tokenizer = hf_tokenizer(directory, decoder_family(model.config))
    theirs = hf_decoder_model(model, tokenizer)
    specials = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id,
                "pad_token": tokenizer.pad_id}
    return save_with_tokenizer_json(theirs, tokenizer, specials, model.config.max_positions,
                                    directory, out)
