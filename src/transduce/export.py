"""Export a checkpoint to other toolkits' formats, to compare decoders on the same weights.

Hugging Face Marian (config, safetensors, SentencePiece files): loadable by `transformers`.
CTranslate2: written through its own model specification, which expresses our layout
directly (post-norm, our position table, decoding from bos).

Marian is the paper's architecture (post-norm, sinusoidal positions, embeddings scaled by
sqrt(d_model), one shared vocabulary), with one difference in layout: its sinusoidal table
puts all the sines first and all the cosines second, where the paper (and we) interleave
them. The export therefore permutes the model dimension of every weight that touches the
residual stream (embeddings, projection inputs and outputs, layer norms): LayerNorm,
attention and the feed-forward network are all equivariant to that permutation, so the
exported model computes exactly the same function.

In both, the decoder starts from our bos token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor

from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transduce.model import Transformer
from transduce.train import checkpoint


class ExportError(ValueError):
    """The model has a feature the target format cannot express; names it."""


def marian_permutation(d_model: int) -> Tensor:
    """Our dimension 2i (sin) -> Marian's i; our 2i + 1 (cos) -> Marian's d/2 + i.
    Returns perm with marian_vector = our_vector[perm]."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def check_exportable(model: Transformer) -> None:
    c = model.config
    problems = _not_a_plain_transformer(c)
    if c.tie_embeddings != "all":
        problems.append(f"tie_embeddings={c.tie_embeddings!r} (Marian shares one matrix: 'all')")
    if c.positional != "sinusoidal":
        problems.append(f"positional={c.positional!r} (Marian has sinusoidal positions)")
    if c.norm_first:
        problems.append("norm_first=True (Marian is post-norm)")
    if c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} (Marian has full multi-head attention)")
    if not c.bias:
        problems.append("bias=False (Marian's projections have biases)")
    if c.d_model % 2:
        problems.append(f"d_model={c.d_model} is odd")
    if problems:
        raise ExportError("cannot export to Marian: " + "; ".join(problems))


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """Our weights under Marian's names, with the model dimension permuted."""
    perm = marian_permutation(model.config.d_model)
    state: dict[str, Tensor] = {}

    def reads_residual(name: str, linear) -> None:      # input dimension is d_model
        state[name + ".weight"] = linear.weight[:, perm]
        state[name + ".bias"] = linear.bias

    def writes_residual(name: str, linear) -> None:     # output dimension is d_model
        state[name + ".weight"] = linear.weight[perm, :]
        state[name + ".bias"] = linear.bias[perm]

    def norm(name: str, layer_norm) -> None:
        state[name + ".weight"] = layer_norm.weight[perm]
        state[name + ".bias"] = layer_norm.bias[perm]

    def attention(name: str, attn) -> None:
        for projection in ("q_proj", "k_proj", "v_proj"):
            reads_residual(f"{name}.{projection}", getattr(attn, projection))
        writes_residual(f"{name}.out_proj", attn.out_proj)

    shared = model.encoder.embed.embedding.weight[:, perm]
    for key in ("model.shared.weight", "model.encoder.embed_tokens.weight",
                "model.decoder.embed_tokens.weight", "lm_head.weight"):
        state[key] = shared
    for i, layer in enumerate(model.encoder.layers):
        prefix = f"model.encoder.layers.{i}"
        attention(f"{prefix}.self_attn", layer.self_attn)
        norm(f"{prefix}.self_attn_layer_norm", layer.norm1)
        reads_residual(f"{prefix}.fc1", layer.ffn.linear1)
        writes_residual(f"{prefix}.fc2", layer.ffn.linear2)
        norm(f"{prefix}.final_layer_norm", layer.norm2)
    for i, layer in enumerate(model.decoder.layers):
        prefix = f"model.decoder.layers.{i}"
        attention(f"{prefix}.self_attn", layer.self_attn)
        norm(f"{prefix}.self_attn_layer_norm", layer.norm1)
        attention(f"{prefix}.encoder_attn", layer.cross_attn)
        norm(f"{prefix}.encoder_attn_layer_norm", layer.norm2)
        reads_residual(f"{prefix}.fc1", layer.ffn.linear1)
        writes_residual(f"{prefix}.fc2", layer.ffn.linear2)
        norm(f"{prefix}.final_layer_norm", layer.norm3)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def marian_config(model: Transformer) -> dict:
    c = model.config
    return {
        "architectures": ["MarianMTModel"], "model_type": "marian",
        "vocab_size": c.tgt_vocab_size, "decoder_vocab_size": c.tgt_vocab_size,
        "d_model": c.d_model, "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers, "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads, "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff, "activation_function": c.activation,
        "max_position_embeddings": c.max_positions, "scale_embedding": True,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "decoder_start_token_id": BOS_ID,
        "forced_eos_token_id": None,  # MarianConfig's default (0) would force pad at the limit
        "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
        "is_encoder_decoder": True, "init_std": 0.02,
    }


def export_hf(path: Path, out: Path) -> Path:
    """Write OUT/ with config.json, model.safetensors, source.spm, target.spm, vocab.json
    and tokenizer_config.json; loadable with MarianMTModel / MarianTokenizer."""
    from transformers import MarianConfig, MarianMTModel

    directory = checkpoint.resolve(path)
    model = checkpoint.load_model_from(directory)
    check_exportable(model)
    tokenizer = Tokenizer(directory / checkpoint.TOKENIZER)
    config = MarianConfig(**marian_config(model))
    marian = MarianMTModel(config).eval()
    missing, unexpected = marian.load_state_dict(marian_state_dict(model), strict=False)
    left = [name for name in missing if "embed_positions" not in name
            and name != "final_logits_bias"]
    if left or unexpected:
        raise ExportError(f"Marian weights not set: {left[:5]}; unknown: {unexpected[:5]}")
    with torch.no_grad():
        marian.final_logits_bias.zero_()
    temporary = out.with_name(out.name + ".tmp")
    if temporary.exists():
        shutil.rmtree(temporary)
    marian.save_pretrained(temporary)
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(tokenizer.path, temporary / name)
    pieces = {tokenizer.processor.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    (temporary / "vocab.json").write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
    (temporary / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": model.config.max_positions,
        "separate_vocabs": False}, indent=2), encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    temporary.rename(out)
    return out


def _not_a_plain_transformer(c) -> list[str]:
    """What neither format can hold: RNN models and non-softmax self-attention."""
    problems = []
    if c.arch != "transformer":
        problems.append(f"arch={c.arch!r} (the format holds Transformers)")
    if c.attention_type != "softmax":
        problems.append(f"attention_type={c.attention_type!r} (the format has softmax attention)")
    return problems


def check_ctranslate2_exportable(model: Transformer) -> None:
    c = model.config
    problems = _not_a_plain_transformer(c)
    if c.positional == "rotary":
        problems.append("positional='rotary' (not in CTranslate2's encoder-decoder spec)")
    if c.kv_heads != c.num_heads:
        # CTranslate2 applies one multi-query switch to encoder and decoder alike, while
        # our encoder always keeps full heads.
        problems.append(f"num_kv_heads={c.num_kv_heads} (CTranslate2's encoder-decoder "
                        f"would make the encoder multi-query too)")
    if not c.bias:
        problems.append("bias=False")
    if problems:
        raise ExportError("cannot export to CTranslate2: " + "; ".join(problems))


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer):
    """Our model as a CTranslate2 TransformerSpec: the same layout, our own position table,
    decoding from our bos token."""
    from ctranslate2.converters import utils
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.config
    spec = transformer_spec.TransformerSpec.from_config(
        (c.num_encoder_layers, c.num_decoder_layers), c.num_heads, pre_norm=c.norm_first,
        activation=common_spec.Activation.RELU if c.activation == "relu" else common_spec.Activation.GELU)
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    spec.config.decoder_start_token = tokenizer.processor.id_to_piece(BOS_ID)

    def array(tensor: Tensor):
        return tensor.detach().float().contiguous().numpy()

    def linear(target, source) -> None:
        target.weight = array(source.weight)
        target.bias = array(source.bias)

    def fused(target, sources) -> None:
        parts = [common_spec.LinearSpec() for _ in sources]
        for part, source in zip(parts, sources):
            linear(part, source)
        utils.fuse_linear(target, parts)

    def norm(target, source) -> None:
        target.gamma, target.beta = array(source.weight), array(source.bias)

    def stack_input(target, stack) -> None:
        embedding = array(stack.embed.embedding.weight)
        if isinstance(target.embeddings, list):
            target.embeddings[0].weight = embedding
        else:
            target.embeddings.weight = embedding
        target.position_encodings.encodings = array(stack.embed.positions(c.max_positions))
        if stack.final_norm is not None:
            norm(target.layer_norm, stack.final_norm)

    def self_attention_and_ffn(target, layer, ffn_norm) -> None:
        """The parts every layer has; CTranslate2 keeps each sub-layer's norm with it."""
        attn = layer.self_attn
        fused(target.self_attention.linear[0], [attn.q_proj, attn.k_proj, attn.v_proj])
        linear(target.self_attention.linear[1], attn.out_proj)
        norm(target.self_attention.layer_norm, layer.norm1)
        linear(target.ffn.linear_0, layer.ffn.linear1)
        linear(target.ffn.linear_1, layer.ffn.linear2)
        norm(target.ffn.layer_norm, ffn_norm)

    stack_input(spec.encoder, model.encoder)
    for target, layer in zip(spec.encoder.layer, model.encoder.layers):
        self_attention_and_ffn(target, layer, layer.norm2)
    stack_input(spec.decoder, model.decoder)
    for target, layer in zip(spec.decoder.layer, model.decoder.layers):
        self_attention_and_ffn(target, layer, layer.norm3)
        linear(target.attention.linear[0], layer.cross_attn.q_proj)
        fused(target.attention.linear[1], [layer.cross_attn.k_proj, layer.cross_attn.v_proj])
        linear(target.attention.linear[2], layer.cross_attn.out_proj)
        norm(target.attention.layer_norm, layer.norm2)
    spec.decoder.projection.weight = array(model.output_proj.weight)
    pieces = [tokenizer.processor.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def export_ctranslate2(path: Path, out: Path, quantization: str | None = None) -> Path:
    """Write a CTranslate2 model directory (quantization: None, "int8", "bfloat16", ...)
    with our tokenizer beside it as spm.model."""
    from ctranslate2.converters.converter import Converter

    directory = checkpoint.resolve(path)
    model = checkpoint.load_model_from(directory)
    check_ctranslate2_exportable(model)
    tokenizer = Tokenizer(directory / checkpoint.TOKENIZER)
    spec = ctranslate2_spec(model, tokenizer)

    class _Prepared(Converter):
        def _load(self):
            return spec

    temporary = out.with_name(out.name + ".tmp")
    if temporary.exists():
        shutil.rmtree(temporary)
    _Prepared().convert(str(temporary), quantization=quantization, force=True)
    shutil.copyfile(tokenizer.path, temporary / checkpoint.TOKENIZER)
    if out.exists():
        shutil.rmtree(out)
    temporary.rename(out)
    return out
