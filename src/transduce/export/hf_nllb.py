"""Export to transformers' M2M100ForConditionalGeneration with NllbTokenizer's files (or
M2M100Tokenizer's): a model imported from NLLB-200 or M2M-100 (positional="fairseq",
language codes), fine-tuned here or not, goes back to the layout it came from
(importers/hf_nllb.py), for `generate`, transformers' Trainer and the tools that read it.
An mBART-50 import (learned positions, embedding_norm, language codes) goes back the same
way, to MBartForConditionalGeneration with MBart50Tokenizer's files: its position
tables gain the two rows transformers skips, and its embeddings' norms are its
layernorm_embedding.

What the export undoes of the import:
- the ids (hf_nllb_vocabulary.py). Each row of the shared matrix is ours of the same
  token. <s> takes our bos's row and is where the decoder starts
  (decoder_start_token_id 0): NLLB starts from </s>, whose row our bos repeats until
  fine-tuning parts the two;
- the tokens never output. M2M100 has no output bias: ours must be one value over every
  token the model may output (the import writes zeros and training keeps them), and the
  tokens never output are generation_config's bad_words_ids, which `generate` applies
  before it forces the target's code, and renormalizes after (renormalize_logits).
Positions are fairseq's on both sides, so no dimension is permuted (hf.py's Marian and
Pegasus permute theirs). The weights are written as they are, without a transformers
model built around them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from transduce import atomic, checkpoint
from transduce.data.tokenizer import Tokenizer
from transduce.export.common import ExportError, not_a_plain_transformer, \
    not_the_papers_layers
from transduce.export.hf import HF_ACTIVATIONS, HF_LAYER_NORM_EPS, generation_config, \
    hf_state_dict
from transduce.export.hf_nllb_vocabulary import SPM_FILE, left_to_the_tokenizer, rows_for, \
    their_codes, their_spm, their_tokenizer
from transduce.importers.hf_mbart import POSITION_OFFSET
from transduce.model import Transformer
from transduce.model.transformer import NEVER_OUTPUT
from transduce.written import write_export_marker

START_ID, THEIR_PAD_ID, THEIR_EOS_ID = 0, 1, 2
TIED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
        "lm_head.weight")


def is_nllb_layout(model: Transformer) -> bool:
    """Whether `export hf` writes this model as NLLB: fairseq's positions, which only an
    NLLB or M2M-100 import has."""
    return model.config.arch == "transformer" and model.config.positional == "fairseq"


def is_mbart_layout(model: Transformer) -> bool:
    """Whether `export hf` writes this model as mBART-50: learned positions, a norm of the
    embeddings and language codes, as an mBART-50 import has."""
    c = model.config
    return c.arch == "transformer" and c.positional == "learned" and c.embedding_norm \
        and bool(model.language_codes)


def check_exportable(model: Transformer, tokenizer: Tokenizer) -> None:
    c = model.config
    family = "mBART-50" if is_mbart_layout(model) else "NLLB"
    problems = not_a_plain_transformer(c, embedding_norm=family == "mBART-50") + \
        not_the_papers_layers(c)
    for name, value, needed, why in (
            ("norm_first", c.norm_first, True, f"{family}'s layers are pre-norm"),
            ("tie_embeddings", c.tie_embeddings, "all", f"{family} shares one matrix"),
            ("num_kv_heads", c.kv_heads, c.num_heads,
             f"{family} has full multi-head attention"),
            ("bias", c.bias, True, f"{family}'s projections have biases"),
            ("layer_norm_eps", c.layer_norm_eps, HF_LAYER_NORM_EPS, f"{family}'s")):
        if value != needed:
            problems.append(f"{name}={value!r} ({why}: {needed!r})")
    if c.activation not in HF_ACTIVATIONS:
        problems.append(f"activation={c.activation!r} (not one of {sorted(HF_ACTIVATIONS)})")
    if tokenizer.target_tokenizer is not tokenizer:
        problems.append(f"targets segmented by a SentencePiece model of their own ({family} "
                        f"segments both sides with one)")
    if problems:
        raise ExportError(f"cannot export to {family}: " + "; ".join(problems))
    _check_output_bias(model)


def _check_output_bias(model: Transformer) -> None:
    """M2M100 has no output bias: ours may only hold one value over the tokens it outputs
    (a shift that softmax ignores), and NEVER_OUTPUT elsewhere."""
    bias = model.output_proj.bias
    if bias is None:
        return
    outputs = bias.detach()[bias.detach() > NEVER_OUTPUT / 2]
    if outputs.numel() and outputs.max() != outputs.min():
        raise ExportError(f"cannot export to NLLB: output_proj.bias varies over the tokens "
                          f"the model outputs (from {outputs.min().item():.4g} to "
                          f"{outputs.max().item():.4g}), and M2M100 has no output bias; "
                          f"a model fine-tuned since keeps it fixed")


def never_output(model: Transformer) -> set[int]:
    """Our ids the model never outputs (output bias NEVER_OUTPUT)."""
    bias = model.output_proj.bias
    if bias is None:
        return set()
    return set((bias.detach() <= NEVER_OUTPUT / 2).nonzero().flatten().tolist())


def _check_every_output_kept(rows: list[int | None], model: Transformer,
                             tokenizer: Tokenizer, family: str) -> None:
    """Every token of ours that the model may output has a row of theirs."""
    lost = set(range(model.config.tgt_vocab_size)) - set(rows) - never_output(model)
    if lost:
        first = min(lost)
        raise ExportError(f"cannot export to {family}: {len(lost)} tokens the model "
                          f"outputs have no id in its tokenizer (the first: {first}, "
                          f"{tokenizer.piece(first)!r})")


def m2m100_config(model: Transformer, vocab_size: int) -> dict:
    """config.json of M2M100ForConditionalGeneration (of MBartForConditionalGeneration,
    for an mBART layout) holding the model."""
    c = model.config
    architecture, model_type = ("MBartForConditionalGeneration", "mbart") \
        if is_mbart_layout(model) else ("M2M100ForConditionalGeneration", "m2m_100")
    return {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": vocab_size, "d_model": c.d_model,
        "encoder_layers": c.num_encoder_layers, "decoder_layers": c.num_decoder_layers,
        "encoder_attention_heads": c.num_heads, "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.d_ff, "decoder_ffn_dim": c.d_ff,
        "activation_function": HF_ACTIVATIONS[c.activation],
        "max_position_embeddings": c.max_positions, "scale_embedding": c.scale_embeddings,
        "dropout": c.dropout, "attention_dropout": c.attention_dropout,
        "activation_dropout": 0.0, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
        "pad_token_id": THEIR_PAD_ID, "bos_token_id": START_ID, "eos_token_id": THEIR_EOS_ID,
        "decoder_start_token_id": START_ID, "forced_eos_token_id": None,
        "tie_word_embeddings": True, "is_encoder_decoder": True, "init_std": 0.02,
        "dtype": "float32"}


def nllb_weights(model: Transformer, rows: list[int | None]) -> dict[str, Tensor]:
    """Our float32 weights under M2M100's names, the shared matrix in their tokenizer's
    order (`rows`), stored once (transformers ties the embeddings and the output)."""
    embedding = model.encoder.embed.embedding.weight.detach()
    ours = torch.tensor([-1 if row is None else row for row in rows])
    shared = embedding.index_select(0, ours.clamp(min=0))            # (V', C)
    shared[ours < 0] = 0.0
    state = hf_state_dict(model, slice(None), shared)
    for tied in TIED:
        del state[tied]
    if is_mbart_layout(model):
        for stack in ("encoder", "decoder"):
            embed = getattr(model, stack).embed
            table = embed.positions.embedding.weight.detach()            # (P, C)
            skipped = table.new_zeros(POSITION_OFFSET, table.shape[1])   # (never read)
            state[f"model.{stack}.embed_positions.weight"] = torch.cat([skipped, table])
            for part in ("weight", "bias"):
                state[f"model.{stack}.layernorm_embedding.{part}"] = \
                    getattr(embed.norm, part).detach()
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def export_hf_nllb(directory: Path, model: Transformer, out: Path) -> Path:
    """Write OUT/ with config.json, generation_config.json, model.safetensors and the
    tokenizer's files (NLLB's sentencepiece.bpe.model, tokenizer.json and
    tokenizer_config.json; M2M-100's with vocab.json instead of tokenizer.json;
    mBART-50's as NLLB's), loadable with AutoModelForSeq2SeqLM and AutoTokenizer."""
    from transformers import M2M100Config, MBartConfig

    tokenizer = Tokenizer(directory / checkpoint.TOKENIZER)
    check_exportable(model, tokenizer)
    mbart = is_mbart_layout(model)
    codes = their_codes(dict(sorted((model.language_codes or {}).items(),
                                    key=lambda item: item[1])), tokenizer, mbart)
    spm_model = their_spm(tokenizer, left_to_the_tokenizer(tokenizer, codes))
    theirs = their_tokenizer(spm_model, codes, checkpoint.read_languages(directory),
                             model.config.max_positions)
    rows = rows_for(theirs, tokenizer, codes)
    _check_every_output_kept(rows, model, tokenizer, codes.family)
    config = (MBartConfig if mbart else M2M100Config)(**m2m100_config(model, len(rows)))
    defaults = generation_config(config)
    banned = never_output(model)
    defaults.bad_words_ids = [[i] for i, row in enumerate(rows) if row is None or row in banned]
    # log-probabilities over the tokens left, as ours (without, a beam's score keeps the
    # banned tokens' share, and beams rank otherwise)
    defaults.renormalize_logits = True
    with atomic.atomic_directory(out) as temporary:
        config.save_pretrained(temporary)
        defaults.save_pretrained(temporary)
        weights = temporary / "model.safetensors"
        save_file(nllb_weights(model, rows), str(weights), metadata={"format": "pt"})
        atomic.open_permissions(weights)                   # written 0600
        theirs.save_pretrained(temporary)
        (temporary / SPM_FILE).write_bytes(spm_model)     # for SentencePiece's tokenizer
        write_export_marker(temporary, f"huggingface-{codes.family.lower()}",
                            checkpoint.trained_steps(directory))
    return out
