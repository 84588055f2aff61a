"""Export to Hugging Face Marian (config, safetensors, SentencePiece files), loadable by
`transformers.MarianMTModel`.

Marian is the paper's architecture (post-norm, sinusoidal positions, embeddings scaled by
sqrt(d_model), one shared vocabulary), with one difference in layout: its sinusoidal table
puts all the sines first and all the cosines second, where the paper (and we) interleave
them. The export therefore permutes the model dimension of every weight that touches the
residual stream (embeddings, projection inputs and outputs, layer norms): LayerNorm,
attention and the feed-forward network are all equivariant to that permutation, so the
exported model computes exactly the same function.

The decoder starts from our bos token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor

from transduce import atomic, checkpoint
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.model import Transformer, load_model

def marian_permutation(d_model: int) -> Tensor:
    """Our dimension 2i (sin) -> Marian's i; our 2i + 1 (cos) -> Marian's d/2 + i.
    Returns perm with marian_vector = our_vector[perm]."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def check_exportable(model: Transformer) -> None:
    c = model.config
    problems = not_a_plain_transformer(c)
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
    model = load_model(directory)
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
    with atomic.atomic_directory(out) as temporary:
        marian.save_pretrained(temporary)
        _write_tokenizer(tokenizer, temporary, model.config.max_positions)
    return out


def _write_tokenizer(tokenizer: Tokenizer, directory: Path, max_positions: int) -> None:
    """The files MarianTokenizer reads: our SentencePiece model for both sides."""
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(tokenizer.path, directory / name)
    pieces = {tokenizer.processor.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    (directory / "vocab.json").write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": max_positions,
        "separate_vocabs": False}, indent=2), encoding="utf-8")
