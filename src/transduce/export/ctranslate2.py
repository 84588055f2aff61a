"""Export to CTranslate2, written through its own model specification, which expresses
our layout directly (post-norm or pre-norm, our position table or T5's relative-position
bias, LayerNorm or RMSNorm, plain or gated feed-forward networks, decoding from bos)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from torch import Tensor

from transduce import atomic, checkpoint
from transduce.data.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer
from transduce.export.common import ExportError, not_a_plain_transformer, require
from transduce.model import Transformer, load_model
from transduce.written import write_export_marker

# Our activations under CTranslate2's names (common_spec.Activation).
CT2_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu-tanh": "GELUTanh", "silu": "SWISH"}


def check_ctranslate2_exportable(model: Transformer) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, score_bias=("t5",), any_head_size=True,
                                       qk_norm=True, embedding_norm=True)   # qk_norm: below
    if c.qk_norm:
        # Measured: with every q_norm and k_norm set, CTranslate2 4.8's encoder-decoder
        # scored otherwise than ours under every placement of the norms tried.
        problems.append("qk_norm=True (CTranslate2's encoder-decoder does not compute it as "
                        "we do; its decoder-only models do)")
    if c.positional == "rotary":
        problems.append("positional='rotary' (not in CTranslate2's encoder-decoder spec)")
    if c.kv_heads != c.num_heads:
        # CTranslate2 applies one multi-query switch to encoder and decoder alike, while
        # our encoder always keeps full heads.
        problems.append(f"num_kv_heads={c.num_kv_heads} (CTranslate2's encoder-decoder "
                        f"would make the encoder multi-query too)")
    if not c.bias and c.norm == "layer":
        problems.append("bias=False with norm='layer' (CTranslate2's LayerNorm has a bias)")
    if problems:
        raise ExportError("cannot export to CTranslate2: " + "; ".join(problems))


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer):
    """Our model as a CTranslate2 TransformerSpec: the same layout, our own position table,
    decoding from our bos token, eos appended to every source as in training; the target
    vocabulary is the targets' own where they have one (a separate vocabulary)."""
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.config
    layout = dict(pre_norm=c.norm_first, ffn_glu=c.gated_ffn, rms_norm=c.norm == "rms",
                  relative_attention_bias=c.positional == "t5", head_dim=c.head_dim,
                  layernorm_embedding=c.embedding_norm,
                  activation=getattr(common_spec.Activation, CT2_ACTIVATIONS[c.activation]))
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(c.num_encoder_layers, c.num_heads, **layout),
        transformer_spec.TransformerDecoderSpec(c.num_decoder_layers, c.num_heads, **layout))
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    piece = tokenizer.target_tokenizer.processor.id_to_piece     # the decoder's specials
    spec.config.unk_token, spec.config.bos_token = piece(UNK_ID), piece(BOS_ID)
    spec.config.eos_token, spec.config.decoder_start_token = piece(EOS_ID), piece(BOS_ID)
    # Every source we train on ends with eos; CTranslate2 appends it, so callers pass the
    # source's pieces as they come from SentencePiece.
    spec.config.add_source_eos = True
    _stack_input(spec.encoder, model.encoder, c)
    for target, layer in zip(spec.encoder.layer, model.encoder.layers):
        set_self_attention_and_ffn(target, layer, layer.norm2, model.encoder.score_bias)
    _stack_input(spec.decoder, model.decoder, c)
    for target, layer in zip(spec.decoder.layer, model.decoder.layers):
        set_self_attention_and_ffn(target, layer, layer.norm3, model.decoder.score_bias)
        set_linear(target.attention.linear[0], layer.cross_attn.q_proj)
        set_fused(target.attention.linear[1], [layer.cross_attn.k_proj, layer.cross_attn.v_proj])
        set_linear(target.attention.linear[2], layer.cross_attn.out_proj)
        set_norm(target.attention.layer_norm, layer.norm2)
    spec.decoder.projection.weight = as_array(model.output_proj.weight)
    if model.output_proj.bias is not None:
        spec.decoder.projection.bias = as_array(model.output_proj.bias)
    spec.register_source_vocabulary(vocabulary_pieces(tokenizer, c.src_vocab_size))
    spec.register_target_vocabulary(vocabulary_pieces(tokenizer.target_tokenizer,
                                                      c.tgt_vocab_size))
    return spec


def as_array(tensor: Tensor):
    return tensor.detach().float().contiguous().numpy()


def set_linear(target, source) -> None:
    target.weight = as_array(source.weight)
    if source.bias is not None:
        target.bias = as_array(source.bias)


def set_fused(target, sources) -> None:
    """Several projections of one input as one (q, k, v -> qkv)."""
    from ctranslate2.converters import utils
    from ctranslate2.specs import common_spec

    parts = [common_spec.LinearSpec() for _ in sources]
    for part, source in zip(parts, sources):
        set_linear(part, source)
    utils.fuse_linear(target, parts)


def set_norm(target, source) -> None:
    """A LayerNorm's gain and bias, or an RMSNorm's gain (CTranslate2's rms_norm spec)."""
    target.gamma = as_array(source.weight)
    if getattr(source, "bias", None) is not None:
        target.beta = as_array(source.bias)


def _stack_input(target, stack, config) -> None:
    """Embedding (scaled or not), position table (none with T5's bias), the norm of the
    embeddings (mBART's) and (pre-norm) final norm of the encoder or decoder."""
    embedding = as_array(stack.embed.embedding.weight)
    if isinstance(target.embeddings, list):
        target.embeddings[0].weight = embedding
    else:
        target.embeddings.weight = embedding
    target.scale_embeddings = config.scale_embeddings
    if stack.embed.positions is not None:
        target.position_encodings.encodings = as_array(
            stack.embed.positions(config.max_positions))
    if stack.embed.norm is not None:
        set_norm(target.layernorm_embedding, stack.embed.norm)
    if stack.final_norm is not None:
        set_norm(target.layer_norm, stack.final_norm)


def vocabulary_pieces(tokenizer, size: int) -> list[str]:
    """The tokenizer's pieces as a CTranslate2 vocabulary of `size` ids (those past the
    tokenizer's, where the model's vocabulary is larger, as <extra_N>)."""
    pieces = [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
    return pieces + [f"<extra_{i}>" for i in range(size - len(pieces))]


def set_self_attention_and_ffn(target, layer, ffn_norm, score_bias=None) -> None:
    """The parts every layer has; CTranslate2 keeps each sub-layer's norm with it (but
    a sandwich's four norms with the layer: Gemma's layout), and T5's relative-position
    table (`score_bias`, one per stack) with every layer's self-attention."""
    attn = layer.self_attn
    set_fused(target.self_attention.linear[0], [attn.q_proj, attn.k_proj, attn.v_proj])
    if score_bias is not None:
        target.self_attention.relative_attention_bias = as_array(score_bias.table.weight)
        target.self_attention.relative_attention_max_distance = \
            np.dtype("int32").type(score_bias.max_distance)
    set_linear(target.self_attention.linear[1], attn.out_proj)
    if getattr(layer, "shared_norm", False):    # Phi's: one norm, with the layer
        set_norm(target.shared_layer_norm, layer.norm1)
    elif getattr(layer, "parallel", False):     # GPT-NeoX's: both norms with the layer
        set_norm(target.input_layer_norm, layer.norm1)
        set_norm(target.post_attention_layer_norm, ffn_norm)
    elif layer.post_norm1 is not None:
        for name, norm in (("input_layer_norm", layer.norm1),
                           ("post_attention_layer_norm", layer.post_norm1),
                           ("pre_feedforward_layer_norm", ffn_norm),
                           ("post_feedforward_layer_norm", layer.post_norm3)):
            set_norm(getattr(target, name), norm)
    else:
        set_norm(target.self_attention.layer_norm, layer.norm1)
        set_norm(target.ffn.layer_norm, ffn_norm)
    if attn.q_norm is not None:                 # qk_norm's, over each head's features
        set_norm(target.self_attention.q_norm, attn.q_norm)
        set_norm(target.self_attention.k_norm, attn.k_norm)
    set_linear(target.ffn.linear_0, layer.ffn.linear1)
    if layer.ffn.linear3 is not None:           # a gated FFN's ungated product
        set_linear(target.ffn.linear_0_noact, layer.ffn.linear3)
    set_linear(target.ffn.linear_1, layer.ffn.linear2)


def export_ctranslate2(path: Path, out: Path, quantization: str | None = None) -> Path:
    """Write a CTranslate2 model directory (quantization: None, "int8", "bfloat16", ...)
    with our tokenizer beside it as spm.model; a language model as a Generator's
    (ctranslate2_decoder.py), an encoder-only one as an Encoder's (ctranslate2_encoder.py)."""
    require("ctranslate2", "export ct2")
    directory = checkpoint.resolve(path)
    model = load_model(directory)
    if model.config.arch in ("decoder", "encoder"):
        check, build = _one_stack_export(model.config.arch)
        check(model)
        tokenizer = checkpoint.load_tokenizer(directory)     # spm.model or tokenizer.json
        files, more = _chat_files(tokenizer, model.config.max_positions)
        return write_ctranslate2(build(model, tokenizer), directory, out, quantization,
                                 tokenizer.path, files=files, **more)
    check_ctranslate2_exportable(model)
    tokenizer = Tokenizer(directory / checkpoint.TOKENIZER)
    codes = model.language_codes
    more = {"language_code_pieces": {code: tokenizer.piece(i) for code, i in codes.items()}} \
        if codes else {}         # a source starts with one, target_prefix gives another
    target = tokenizer.target_tokenizer
    return write_ctranslate2(ctranslate2_spec(model, tokenizer), directory, out, quantization,
                             tokenizer.path, target.path if tokenizer.separate else None,
                             **more)


def _chat_files(tokenizer, max_positions: int) -> tuple[dict[str, str], dict]:
    """An instruct model's chat template, as tokenizer_config.json beside its
    tokenizer.json (for transformers' apply_chat_template: CTranslate2 has none), and its
    end tokens for the marker (a Generator's end_token); nothing for another model."""
    if getattr(tokenizer, "chat_template", None) is None:
        return {}, {}
    from transduce.export.hf import tokenizer_config

    specials = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
    ends = [tokenizer.piece(token) for token in (tokenizer.eos_id, *tokenizer.stop_ids)]
    return ({"tokenizer_config.json": tokenizer_config(tokenizer, specials, max_positions)},
            {"end_tokens": ends})


def _one_stack_export(arch: str):
    """(check, spec builder) of a language model's (a Generator's) or an encoder's."""
    if arch == "decoder":
        from transduce.export import ctranslate2_decoder as module

        return (module.check_ctranslate2_decoder_exportable,
                module.ctranslate2_decoder_spec)
    from transduce.export import ctranslate2_encoder as module

    return module.check_ctranslate2_encoder_exportable, module.ctranslate2_encoder_spec


def write_ctranslate2(spec, directory: Path, out: Path, quantization: str | None,
                      tokenizer_file: Path, target_tokenizer_file: Path | None = None,
                      files: dict[str, str] | None = None, **more) -> Path:
    """Convert a filled model specification of the checkpoint at `directory` into OUT,
    whole or not at all, with the tokenizer file beside it (under its own name; and a
    separate target vocabulary's), `files` (name -> text) and our export marker (with
    `more`)."""
    from ctranslate2.converters.converter import Converter

    class _Prepared(Converter):
        def _load(self):
            return spec

    with atomic.atomic_directory(out) as temporary:
        _Prepared().convert(str(temporary), quantization=quantization, force=True)
        for file in (tokenizer_file, target_tokenizer_file):
            if file is not None:
                shutil.copyfile(file, temporary / file.name)
        for name, text in (files or {}).items():
            (temporary / name).write_text(text, encoding="utf-8")
        write_export_marker(temporary, "ctranslate2", checkpoint.trained_steps(directory),
                            **more)
    return out
