"""Export to Hugging Face transformers (config, safetensors, SentencePiece files): a
post-norm model as Marian (`MarianMTModel`), a pre-norm one as Pegasus
(`PegasusForConditionalGeneration`).

Marian is the paper's architecture (post-norm, sinusoidal positions, embeddings scaled by
sqrt(d_model), one shared vocabulary, or one per side: `share_encoder_decoder_embeddings`
false, with MarianTokenizer's `separate_vocabs`). Pegasus is the same with pre-norm layers
and a final LayerNorm after each stack, which is exactly our `norm_first` layout; its
sinusoids have the paper's frequencies and start at position 0, as ours. Both put all
the sines of their table first and all the cosines second, where the paper (and we)
interleave them. The export therefore permutes the model dimension of every weight that
touches the residual stream (embeddings, projection inputs and outputs, layer norms):
LayerNorm, attention and the feed-forward network are all equivariant to that
permutation, so the exported model computes exactly the same function.

The decoder starts from our bos token. Both read the tokenizer files of MarianTokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from transduce import atomic, checkpoint
from transduce.config import ModelConfig
from transduce.data.hf_tokenizer import TOKENIZER_JSON
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transduce.export.common import ExportError, not_a_plain_transformer, \
    not_the_papers_layers, require
from transduce.importers.marian_vocabulary import LANGUAGE_CODE, WORD_BOUNDARY
from transduce.model import Transformer, load_model
from transduce.model.positional import sines_first_permutation
from transduce.written import write_export_marker

# Our activations under transformers' names (ACT2FN).
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu-tanh": "gelu_pytorch_tanh",
                  "silu": "swish"}
HF_LAYER_NORM_EPS = 1e-5          # both build nn.LayerNorm with its default eps


class Family(NamedTuple):
    name: str
    model_class: str       # transformers' class names
    config_class: str
    model_type: str


MARIAN = Family("Marian", "MarianMTModel", "MarianConfig", "marian")
PEGASUS = Family("Pegasus", "PegasusForConditionalGeneration", "PegasusConfig", "pegasus")


def hf_family(config: ModelConfig) -> Family:
    """The transformers model that holds this layout: Pegasus for pre-norm, else Marian."""
    return PEGASUS if config.norm_first else MARIAN


def check_exportable(model: Transformer) -> None:
    c = model.config
    problems = not_a_plain_transformer(c) + not_the_papers_layers(c)
    if c.tie_embeddings in ("none", "embeddings"):
        problems.append(f"tie_embeddings={c.tie_embeddings!r} (the format's output is the "
                        f"target embedding)")
    elif c.tie_embeddings == "decoder" and hf_family(c) is PEGASUS:
        problems.append("tie_embeddings='decoder' (Pegasus shares one matrix between both "
                        "sides; post-norm models, exported as Marian, can have one each)")
    if c.positional != "sinusoidal":
        problems.append(f"positional={c.positional!r} (the format has sinusoidal positions)")
    if c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} (the format has full multi-head "
                        "attention)")
    if not c.bias:
        problems.append("bias=False (the format's projections have biases)")
    if c.d_model % 2:
        problems.append(f"d_model={c.d_model} is odd")
    if c.activation not in HF_ACTIVATIONS:
        problems.append(f"activation={c.activation!r} (not one of {sorted(HF_ACTIVATIONS)})")
    if c.layer_norm_eps != HF_LAYER_NORM_EPS:
        problems.append(f"layer_norm_eps={c.layer_norm_eps} (the format's is "
                        f"{HF_LAYER_NORM_EPS})")
    if problems:
        raise ExportError(f"cannot export to {hf_family(c).name}: " + "; ".join(problems))


def hf_state_dict(model: Transformer, perm: Tensor | slice | None = None,
                  shared: Tensor | None = None) -> dict[str, Tensor]:
    """Our weights under the names of BART's family (Marian, Pegasus, M2M-100), the
    model dimension permuted by `perm` (default: sines first, for Marian's and Pegasus's
    sinusoids; slice(None) keeps it), the (V, C) `shared` matrix (default: our embedding)
    under the embeddings' and the output's names; a model with an embedding for each
    side (tie_embeddings "decoder") has the encoder's and the decoder's. Views of our
    weights where nothing is permuted."""
    perm = sines_first_permutation(model.config.d_model) if perm is None else perm
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

    if model.config.tie_embeddings == "all":
        shared = model.encoder.embed.embedding.weight[:, perm] if shared is None else shared
        for key in ("model.shared.weight", "model.encoder.embed_tokens.weight",
                    "model.decoder.embed_tokens.weight", "lm_head.weight"):
            state[key] = shared
    else:                 # the output is the decoder's embedding (check_exportable)
        state["model.encoder.embed_tokens.weight"] = model.encoder.embed.embedding.weight[:, perm]
        for key in ("model.decoder.embed_tokens.weight", "lm_head.weight"):
            state[key] = model.decoder.embed.embedding.weight[:, perm]
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
    for stack in ("encoder", "decoder"):      # pre-norm: each stack ends with a LayerNorm
        final_norm = getattr(model, stack).final_norm
        if final_norm is not None:
            norm(f"model.{stack}.layer_norm", final_norm)
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


def hf_config(model: Transformer) -> dict:
    """The config of the transformers model that holds this one (hf_family)."""
    c = model.config
    family = hf_family(c)
    values = {
        "architectures": [family.model_class], "model_type": family.model_type,
        "vocab_size": c.tgt_vocab_size,
        "d_model": c.d_model, "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers, "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads, "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff, "activation_function": HF_ACTIVATIONS[c.activation],
        "max_position_embeddings": c.max_positions, "scale_embedding": c.scale_embeddings,
        # the model's own rates, so that training the export goes on as ours would (our
        # feed-forward has no dropout of its own: activation_dropout 0)
        "dropout": c.dropout, "attention_dropout": c.attention_dropout, "activation_dropout": 0.0,
        "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "decoder_start_token_id": BOS_ID,
        "forced_eos_token_id": None,  # the configs' defaults would force a token at the limit
        "tie_word_embeddings": True, "is_encoder_decoder": True, "init_std": 0.02,
    }
    if family is MARIAN:
        values.update(vocab_size=c.src_vocab_size, decoder_vocab_size=c.tgt_vocab_size,
                      share_encoder_decoder_embeddings=c.tie_embeddings == "all")
    return values


def hf_model(model: Transformer):
    """A transformers model holding our weights (in eval mode)."""
    import transformers

    check_exportable(model)
    family = hf_family(model.config)
    config = getattr(transformers, family.config_class)(**hf_config(model))
    theirs = getattr(transformers, family.model_class)(config).eval()
    missing, unexpected = theirs.load_state_dict(hf_state_dict(model), strict=False)
    left = [name for name in missing if "embed_positions" not in name
            and name != "final_logits_bias"]
    if left or unexpected:
        raise ExportError(f"{family.name} weights not set: {left[:5]}; unknown: "
                          f"{unexpected[:5]}")
    with torch.no_grad():       # the output bias (an imported Marian model's), or none
        bias = model.output_proj.bias
        theirs.final_logits_bias.copy_(torch.zeros(1, model.config.tgt_vocab_size)
                                       if bias is None else bias.detach()[None])
    theirs.generation_config = generation_config(theirs.config)
    return theirs


def generation_config(config, max_length: int | None = None):
    """`generate`'s defaults for the export: the token ids of its config, our search's
    settings (beam 4, length penalty 0.6, which transformers applies as length^0.6 where
    we use GNMT's), and outputs up to the position table's end (`max_length` where the
    config has no table: BLOOM's), where transformers' default would cut them at 20
    tokens."""
    from transformers import GenerationConfig

    defaults = GenerationConfig.from_model_config(config)
    defaults.update(max_length=max_length or config.max_position_embeddings, num_beams=4,
                    length_penalty=0.6, early_stopping=True)
    return defaults


def export_hf(path: Path, out: Path) -> Path:
    """Write OUT/ with config.json, model.safetensors, source.spm, target.spm, vocab.json,
    tokenizer_config.json and our export marker (written.py); loadable with transformers'
    Auto classes (AutoModelForSeq2SeqLM, AutoTokenizer) -> OUT. A decoder-only model is
    written as Llama, Mistral, Qwen, Gemma, BLOOM or GPT-2 (hf_decoder.py), an
    encoder-only one as BERT (hf_encoder.py) or ModernBERT (hf_modernbert.py), an NLLB, M2M-100 or mBART-50 import as
    itself (hf_nllb.py), a model of T5's layout as T5 (hf_t5.py)."""
    require("transformers", "export hf")
    directory = checkpoint.resolve(path)
    model = load_model(directory)
    if model.config.arch == "decoder":
        from transduce.export.hf_decoder import export_hf_decoder

        return export_hf_decoder(directory, model, out)
    if model.config.arch == "encoder":
        from transduce.export.hf_encoder import export_hf_encoder
        from transduce.export.hf_modernbert import export_hf_modernbert, is_modernbert_layout

        export = export_hf_modernbert if is_modernbert_layout(model.config) \
            else export_hf_encoder
        return export(directory, model, out)
    from transduce.export.hf_nllb import export_hf_nllb, is_mbart_layout, is_nllb_layout

    if is_nllb_layout(model) or is_mbart_layout(model):
        return export_hf_nllb(directory, model, out)
    from transduce.export.hf_t5 import export_hf_t5, is_t5_layout

    if is_t5_layout(model):
        return export_hf_t5(directory, model, out)
    theirs = hf_model(model)
    tokenizer = Tokenizer(directory / checkpoint.TOKENIZER)
    with atomic.atomic_directory(out) as temporary:
        theirs.save_pretrained(temporary)
        for weights in temporary.glob("*.safetensors"):   # written 0600
            atomic.open_permissions(weights)
        write_marian_tokenizer(tokenizer, temporary, model.config.max_positions,
                               checkpoint.read_languages(directory))
        write_export_marker(temporary, f"huggingface-{theirs.config.model_type}",
                            checkpoint.trained_steps(directory))
    return out


def save_with_tokenizer_json(theirs, tokenizer, specials: dict[str, int], max_positions: int,
                             directory: Path, out: Path, extra=None,
                             settings: dict | None = None) -> Path:
    """Write transformers model `theirs` (of the checkpoint at `directory`) as OUT/ with
    its tokenizer as tokenizer.json, a tokenizer_config.json naming the special tokens
    (`specials`: "bos_token" etc. -> id) with any other `settings`, our export marker,
    and what extra(directory) writes, if given -> OUT."""
    with atomic.atomic_directory(out) as temporary:
        theirs.save_pretrained(temporary)
        for weights in temporary.glob("*.safetensors"):   # written 0600
            atomic.open_permissions(weights)
        tokenizer.save(temporary / TOKENIZER_JSON)
        (temporary / "tokenizer_config.json").write_text(
            tokenizer_config(tokenizer, specials, max_positions, settings),
            encoding="utf-8")
        write_export_marker(temporary, f"huggingface-{theirs.config.model_type}",
                            checkpoint.trained_steps(directory))
        if extra is not None:
            extra(temporary)
    return out


def tokenizer_config(tokenizer, specials: dict[str, int], max_positions: int,
                     settings: dict | None = None) -> str:
    """tokenizer_config.json beside a tokenizer.json: transformers' fast tokenizer, the
    special tokens (`specials`: "bos_token" etc. -> id) by their pieces, an instruct
    model's chat template, where apply_chat_template finds it, and any other
    `settings`."""
    return json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{name: tokenizer.piece(token) for name, token in specials.items()},
        **_chat_template(tokenizer), "model_max_length": max_positions, **(settings or {})},
        indent=2)


def _chat_template(tokenizer) -> dict[str, str]:
    """An instruct model's chat template, where transformers' apply_chat_template finds
    it."""
    template = getattr(tokenizer, "chat_template", None)
    return {} if template is None else {"chat_template": template.template}


def write_marian_tokenizer(tokenizer: Tokenizer, directory: Path, max_positions: int,
                           languages: tuple[str, str] | None,
                           settings: dict | None = None) -> None:
    """The files MarianTokenizer reads: our SentencePiece model for each side (the
    targets' own, a separate vocabulary's or an imported Marian model's, for target.spm),
    vocab.json (and target_vocab.json for a separate target vocabulary), where a language
    code is named as MarianTokenizer looks it up (>>fra<<, not our "▁>>fra<<"), and
    tokenizer_config.json, with the model's languages if it records them and any other
    `settings`."""
    shutil.copyfile(tokenizer.path, directory / "source.spm")
    shutil.copyfile(tokenizer.target_tokenizer.path, directory / "target.spm")
    _write_marian_vocabulary(tokenizer, directory / "vocab.json")
    if tokenizer.separate:
        _write_marian_vocabulary(tokenizer.target_tokenizer, directory / "target_vocab.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": max_positions,
        "separate_vocabs": tokenizer.separate,
        **({"source_lang": languages[0], "target_lang": languages[1]} if languages else {}),
        **(settings or {})}, indent=2), encoding="utf-8")


def _write_marian_vocabulary(tokenizer: Tokenizer, path: Path) -> None:
    pieces = {_marian_piece(tokenizer.processor.id_to_piece(i)): i
              for i in range(tokenizer.vocab_size)}
    path.write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")


def _marian_piece(piece: str) -> str:
    """Our piece's name in vocab.json: a language code without the word boundary that our
    tokenizer puts before it (importers/marian_vocabulary.py)."""
    code = piece.removeprefix(WORD_BOUNDARY)
    return code if code != piece and LANGUAGE_CODE.match(code) else piece
