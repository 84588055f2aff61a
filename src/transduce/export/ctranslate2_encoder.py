"""Export an encoder-only model (BERT's layout: ours, or an import) to CTranslate2, as a
`ctranslate2.Encoder` model through its encoder specification: token, position and
segment embeddings added (a DistilBERT's: no segments), the embedding LayerNorm,
post-norm or pre-norm layers, and the pooler (dense + tanh, or ReLU, on the first
token). `Encoder.forward_batch` gives our hidden
states (last_hidden_state) and pooled output (pooler_output); the heads (masked LM,
next sentence, classifier) are not part of CTranslate2's encoder and stay ours."""

from __future__ import annotations

from transduce.export.common import ExportError, not_a_plain_transformer, \
    not_the_papers_layers
from transduce.export.ctranslate2 import CT2_ACTIVATIONS, as_array, set_linear, set_norm, \
    set_self_attention_and_ffn, vocabulary_pieces
from transduce.model import EncoderOnly


def check_ctranslate2_encoder_exportable(model: EncoderOnly) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, arch="encoder") + not_the_papers_layers(c)
    if c.positional not in ("learned", "sinusoidal"):
        problems.append(f"positional={c.positional!r} (CTranslate2's encoder adds a table "
                        f"of positions: learned or sinusoidal)")
    if c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} (CTranslate2's encoder has full "
                        f"multi-head attention)")
    if not c.bias:
        problems.append("bias=False (CTranslate2's encoder projections have biases)")
    if c.activation not in CT2_ACTIVATIONS:
        problems.append(f"activation={c.activation!r}")
    if problems:
        raise ExportError("cannot export to CTranslate2: " + "; ".join(problems))


def ctranslate2_encoder_spec(model: EncoderOnly, tokenizer):
    """Our encoder-only model as a CTranslate2 TransformerEncoderModelSpec, with the
    tokenizer's pieces as its vocabulary (extra ids as <extra_N>)."""
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.config
    encoder_spec = transformer_spec.TransformerEncoderSpec(
        c.num_encoder_layers, c.num_heads, pre_norm=c.norm_first,
        activation=getattr(common_spec.Activation, CT2_ACTIVATIONS[c.activation]),
        layernorm_embedding=True, num_source_embeddings=2 if c.type_vocab_size else 1,
        embeddings_merge=common_spec.EmbeddingsMerge.ADD)
    pooling = {"tanh": common_spec.Activation.Tanh, "relu": common_spec.Activation.RELU,
               "gelu": common_spec.Activation.GELU}
    spec = transformer_spec.TransformerEncoderModelSpec(
        encoder_spec, pooling_layer=True, pooling_activation=pooling[c.pooler_activation])
    encoder, embed = spec.encoder, model.embed
    encoder.scale_embeddings = False
    encoder.embeddings[0].weight = as_array(embed.embedding.weight)
    if embed.segments is not None:
        encoder.embeddings[1].weight = as_array(embed.segments.weight)
    encoder.position_encodings.encodings = as_array(embed.positions(c.max_positions))
    set_norm(encoder.layernorm_embedding, embed.norm)
    if model.encoder.final_norm is not None:
        set_norm(encoder.layer_norm, model.encoder.final_norm)
    for target, layer in zip(encoder.layer, model.encoder.layers):
        set_self_attention_and_ffn(target, layer, layer.norm2)
    set_linear(spec.pooler_dense, model.pooler)
    pieces = vocabulary_pieces(tokenizer, c.src_vocab_size)
    spec.register_vocabulary(pieces)
    unk = tokenizer.unk_id
    spec.config.unk_token = pieces[tokenizer.pad_id if unk is None else unk]
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    return spec
