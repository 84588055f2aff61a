"""Export a decoder-only model to CTranslate2, as a `ctranslate2.Generator` model, through
its decoder specification: pre-norm layers with LayerNorm or RMSNorm, plain or gated
feed-forward networks, grouped-query attention, and our position table or rotary
positions ("rotate half", CTranslate2's non-interleaved rotation). A prompt goes in as
the tokenizer's pieces after bos, as our language models read it."""

from __future__ import annotations

from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.ctranslate2 import CT2_ACTIVATIONS, as_array, set_norm, \
    set_self_attention_and_ffn, vocabulary_pieces
from transduce.model import DecoderOnly


def check_ctranslate2_decoder_exportable(model: DecoderOnly) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, arch="decoder", any_head_size=True)
    if not c.norm_first:
        problems.append("norm_first=False (CTranslate2's decoder-only models are pre-norm)")
    if c.activation not in CT2_ACTIVATIONS:
        problems.append(f"activation={c.activation!r}")
    if c.rope_scaling != "none":
        # CTranslate2 4.8's Llama 3.1 scaling, given these fields, generated other tokens
        # than transformers and we do (the import tests); linear is not checked either.
        problems.append(f"rope_scaling={c.rope_scaling!r} (CTranslate2's scaled rotary "
                        f"positions are not checked against ours; its Llama 3.1 scaling "
                        f"gave other tokens)")
    if problems:
        raise ExportError("cannot export to CTranslate2: " + "; ".join(problems))


def ctranslate2_decoder_spec(model: DecoderOnly, tokenizer):
    """Our language model as a CTranslate2 TransformerDecoderModelSpec, with the
    tokenizer's pieces as its vocabulary (extra ids, where the model's vocabulary is
    larger, as <extra_N>)."""
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.config
    rotary = c.positional == "rotary"
    spec = transformer_spec.TransformerDecoderModelSpec.from_config(
        c.num_decoder_layers, c.num_heads, pre_norm=True,
        activation=getattr(common_spec.Activation, CT2_ACTIVATIONS[c.activation]),
        ffn_glu=c.gated_ffn, rms_norm=c.norm == "rms",
        rotary_dim=0 if rotary else None, rotary_interleave=False, rotary_base=c.rope_base,
        num_heads_kv=None if c.kv_heads == c.num_heads else c.kv_heads, head_dim=c.head_dim)
    decoder = spec.decoder
    decoder.scale_embeddings = c.scale_embeddings
    decoder.embeddings.weight = as_array(model.decoder.embed.embedding.weight)
    if not rotary:
        decoder.position_encodings.encodings = as_array(
            model.decoder.embed.positions(c.max_positions))
    set_norm(decoder.layer_norm, model.decoder.final_norm)
    for target, layer in zip(decoder.layer, model.decoder.layers):
        set_self_attention_and_ffn(target, layer, layer.norm3)
    decoder.projection.weight = as_array(model.output_proj.weight)
    pieces = vocabulary_pieces(tokenizer, c.tgt_vocab_size)
    spec.register_vocabulary(pieces)
    unk = tokenizer.unk_id      # None: none (GPT-2's byte-level BPE spells every byte)
    spec.config.bos_token, spec.config.eos_token = pieces[tokenizer.bos_id], \
        pieces[tokenizer.eos_id]
    spec.config.unk_token = pieces[tokenizer.eos_id if unk is None else unk]
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    return spec
