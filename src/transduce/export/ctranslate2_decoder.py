"""Export a decoder-only model to CTranslate2, as a `ctranslate2.Generator` model, through
its decoder specification: pre-norm layers with LayerNorm or RMSNorm, plain or gated
feed-forward networks, grouped-query attention, and our position table or rotary
positions ("rotate half", CTranslate2's non-interleaved rotation; scaled linearly or as
Llama 3.1's; on part of each head, GPT-NeoX's), softmax or sliding-window attention (or
sliding layers among full ones, each with its rotary base: Gemma 3's), queries and keys
normalized per head by RMSNorm (Qwen3's qk_norm), sandwich norms (Gemma's), parallel
residuals (GPT-NeoX's; over one norm, Phi's), a bias on the output (Phi's), ALiBi's
score biases with a norm of the embeddings (BLOOM's). A prompt goes in as the
tokenizer's pieces after bos, as our language models read it."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

from transduce.errors import TransduceWarning
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.ctranslate2 import CT2_ACTIVATIONS, as_array, set_fused, set_norm, \
    set_self_attention_and_ffn, vocabulary_pieces
from transduce.export.hf_gpt_neox import in_neox_order
from transduce.model import DecoderOnly


def check_ctranslate2_decoder_exportable(model: DecoderOnly) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, arch="decoder", sliding=True, any_head_size=True,
                                       qk_norm=True, gemma=True, score_bias=("alibi",),
                                       embedding_norm=True, neox=True, phi=True,
                                       attention_bias=True)
    if c.qk_norm and c.norm != "rms":
        problems.append(f"qk_norm=True with norm={c.norm!r} (CTranslate2 normalizes queries "
                        f"and keys by RMSNorm only)")
    if not c.norm_first:
        problems.append("norm_first=False (CTranslate2's decoder-only models are pre-norm)")
    if c.activation not in CT2_ACTIVATIONS:
        problems.append(f"activation={c.activation!r}")
    if problems:
        raise ExportError("cannot export to CTranslate2: " + "; ".join(problems))


def _warn_of_long_prompts(window: int) -> None:
    """CTranslate2 4.8 generates exactly (tested) from a prompt within its window, the
    token's own key among them, and on past it; a longer prompt's tokens came out otherwise
    than ours and transformers', and score_batch fails on a sequence longer than it."""
    warnings.warn(f"CTranslate2's sliding window ({window} keys) gives this model's tokens "
                  f"from prompts of up to {window} tokens; from a longer prompt it computes "
                  f"others, and its score_batch fails on sequences longer than {window} "
                  f"tokens", TransduceWarning, stacklevel=3)


def _set_rope_scaling(spec, c) -> None:
    """Our scaled rotary frequencies as every self-attention's fields. CTranslate2's
    runtime reads the factor, the original context and the two band limits of each
    attention layer, but its spec declares the factor for linear scaling alone (and its
    own Llama converter leaves the factor and the context unset, so that Llama 3.1's
    scaling changes nothing there): fields it does not declare are set past its frozen
    attributes, and written as any other."""
    import numpy as np

    fields = {"rotary_scaling_factor": np.float32(c.rope_factor)}
    if c.rope_scaling == "llama3":
        fields |= {"original_max_position_embeddings": np.int32(c.rope_original_positions),
                   "rotary_low_freq_factor": np.float32(c.rope_low_freq_factor),
                   "rotary_high_freq_factor": np.float32(c.rope_high_freq_factor)}
    for layer in spec.decoder.layer:
        for name, value in fields.items():
            object.__setattr__(layer.self_attention, name, value)


# A self-attention spec's fields of scaled rotary positions (_set_rope_scaling's).
_SCALING_FIELDS = ("rotary_scaling_type", "rotary_scaling_factor",
                   "original_max_position_embeddings", "rotary_low_freq_factor",
                   "rotary_high_freq_factor")


def _set_layer_attention(spec, c) -> None:
    """Sliding layers among full ones (Gemma 3's): each layer's window (0: none) and
    rotary base. The decoder keeps its window, as CTranslate2's Gemma 3 converter leaves
    it: a prompt goes in a window at a time. (With none there, a prompt longer than the
    window goes in whole and its sliding layers attend past the window: measured.)"""
    import numpy as np

    local_base = c.rope_base if c.local_rope_base is None else c.local_rope_base
    for i, layer in enumerate(spec.decoder.layer):
        attention = layer.self_attention
        sliding = c.layer_attention_type(i) == "sliding"
        attention.sliding_window = np.int32(c.attention_window + 1 if sliding else 0)
        attention.rotary_base = np.float32(local_base if sliding else c.rope_base)
        if sliding and c.local_rope_base is not None:     # unscaled there
            for name in _SCALING_FIELDS:
                if hasattr(attention, name):
                    object.__delattr__(attention, name)


def _neox_ordered(projection, c) -> SimpleNamespace:
    """A query or key projection with each head's rows in GPT-NeoX's order."""
    weight, bias = in_neox_order(projection, c)
    return SimpleNamespace(weight=weight, bias=bias)


def ctranslate2_decoder_spec(model: DecoderOnly, tokenizer):
    """Our language model as a CTranslate2 TransformerDecoderModelSpec, with the
    tokenizer's pieces as its vocabulary (extra ids, where the model's vocabulary is
    larger, as <extra_N>)."""
    from ctranslate2.specs import common_spec, transformer_spec

    from ctranslate2.specs.attention_spec import RotaryScalingType

    c = model.config
    rotary = c.positional == "rotary"
    scaling = {"none": None, "linear": RotaryScalingType.Linear,
               "llama3": RotaryScalingType.Llama3}[c.rope_scaling] if rotary else None
    spec = transformer_spec.TransformerDecoderModelSpec.from_config(
        c.num_decoder_layers, c.num_heads, pre_norm=True,
        activation=getattr(common_spec.Activation, CT2_ACTIVATIONS[c.activation]),
        ffn_glu=c.gated_ffn, rms_norm=c.norm == "rms",
        rotary_dim=(c.rotary_dims or 0) if rotary else None, rotary_interleave=False,
        rotary_base=c.rope_base, parallel_residual=c.parallel_residual,
        shared_layer_norm=c.shared_norm,
        rotary_scaling_type=scaling, rotary_scaling_factor=c.rope_factor,
        num_heads_kv=None if c.kv_heads == c.num_heads else c.kv_heads, head_dim=c.head_dim,
        # Mistral's window counts the token's own key, ours the keys before it
        sliding_window=c.attention_window + 1 if c.attention_type == "sliding" else None,
        qk_norm=c.qk_norm, pre_post_layer_norm=c.sandwich_norm,
        # ALiBi's bias from the last key back, which differs from ours (from each query
        # back) by a constant per query: softmax ignores it
        alibi=c.positional == "alibi", layernorm_embedding=c.embedding_norm)
    if scaling is not None:
        _set_rope_scaling(spec, c)
    if c.full_attention_layers:
        _set_layer_attention(spec, c)
    if c.attention_type == "sliding":
        _warn_of_long_prompts(c.attention_window + 1)
    decoder = spec.decoder
    decoder.scale_embeddings = c.scale_embeddings
    decoder.embeddings.weight = as_array(model.decoder.embed.embedding.weight)
    if model.decoder.embed.positions is not None:
        decoder.position_encodings.encodings = as_array(
            model.decoder.embed.positions(c.max_positions))
    if model.decoder.embed.norm is not None:
        set_norm(decoder.layernorm_embedding, model.decoder.embed.norm)
    set_norm(decoder.layer_norm, model.decoder.final_norm)
    for target, layer in zip(decoder.layer, model.decoder.layers):
        set_self_attention_and_ffn(target, layer, layer.norm3)
        if c.rotary_dims is not None:        # CTranslate2 rotates GPT-NeoX's order
            attn = layer.self_attn
            set_fused(target.self_attention.linear[0],
                      [_neox_ordered(attn.q_proj, c), _neox_ordered(attn.k_proj, c),
                       attn.v_proj])
    decoder.projection.weight = as_array(model.output_proj.weight)
    if model.output_proj.bias is not None:
        decoder.projection.bias = as_array(model.output_proj.bias)
    pieces = vocabulary_pieces(tokenizer, c.tgt_vocab_size)
    spec.register_vocabulary(pieces)
    unk = tokenizer.unk_id      # None: none (GPT-2's byte-level BPE spells every byte)
    spec.config.bos_token, spec.config.eos_token = pieces[tokenizer.bos_id], \
        pieces[tokenizer.eos_id]
    spec.config.unk_token = pieces[tokenizer.eos_id if unk is None else unk]
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    return spec
