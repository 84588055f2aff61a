"""Export to transformers' T5ForConditionalGeneration: a model of T5's layout (pre-norm
RMSNorm, no biases, T5's relative-position bias, one matrix for both embeddings) goes to
the layout an import reads (importers/hf_t5.py), fine-tuned here or not, for
`generate`, transformers' Trainer and the tools that read T5.

What the export undoes of the import:
- T5 does not scale its scores: each query projection is divided by sqrt(d_kv);
- a tied output is scaled by d_model^-0.5 in T5 (tie_word_embeddings, which transformers
  5 writes as scale_decoder_outputs too): the decoder's final gain is multiplied by
  sqrt(d_model) to cancel it. An output of its own (tie_embeddings "embeddings") is
  lm_head, unscaled;
- the tokens never output (an import's pad and bos) are generation_config's
  suppress_tokens, with the log-probabilities renormalized over the others, as ours.
The ids stay ours (pad 0, bos 1, where the decoder starts, eos 2): the tokenizer is
MarianTokenizer's files over our SentencePiece model (source.spm, target.spm,
vocab.json), which give our ids with </s> appended, as T5Tokenizer does; spiece.model
beside them (the same model, no sentinels added: extra_ids 0) lets `import hf-t5` read
the export back. The weights are written as they are, without a transformers model
built around them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from transduce import atomic, checkpoint
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.hf import write_marian_tokenizer
from transduce.importers.hf_t5 import FFN_NORM, SUBLAYERS
from transduce.model import Transformer
from transduce.model.transformer import NEVER_OUTPUT
from transduce.written import write_export_marker

SPM_FILE = "spiece.model"
# (activation, gated) -> feed_forward_proj; transformers reads "gated-gelu" as tanh GELU.
FEED_FORWARD = {("relu", False): "relu", ("gelu", False): "gelu",
                ("gelu-tanh", False): "gelu_new", ("silu", False): "silu",
                ("relu", True): "gated-relu", ("gelu-tanh", True): "gated-gelu",
                ("silu", True): "gated-silu"}


def is_t5_layout(model: Transformer) -> bool:
    """Whether `export hf` writes this encoder-decoder as T5: T5's relative positions."""
    return model.config.arch == "transformer" and model.config.positional == "t5"


def check_exportable(model: Transformer) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, score_bias=("t5",), any_head_size=True)
    for name, value, needed, why in (
            ("norm", c.norm, "rms", "T5's norms are RMSNorm"),
            ("norm_first", c.norm_first, True, "T5's layers are pre-norm"),
            ("bias", c.bias, False, "T5 has no biases"),
            ("qkv_bias", c.qkv_bias, False, "T5 has no biases"),
            ("scale_embeddings", c.scale_embeddings, False, "T5 does not scale them"),
            ("num_kv_heads", c.kv_heads, c.num_heads, "T5 has full multi-head attention")):
        if value != needed:
            problems.append(f"{name}={value!r} ({why})")
    if not c.shares_embeddings:
        problems.append(f"tie_embeddings={c.tie_embeddings!r} (T5 embeds both sides with one "
                        f"matrix)")
    if (c.activation, c.gated_ffn) not in FEED_FORWARD:
        problems.append(f"activation={c.activation!r} with gated_ffn={c.gated_ffn} (T5's "
                        f"gated GELU is the tanh approximation)")
    bias = model.output_proj.bias
    if bias is not None and not torch.all((bias == 0) | (bias == NEVER_OUTPUT)):
        problems.append("an output bias other than tokens never output (T5 has none)")
    if problems:
        raise ExportError("cannot export to T5: " + "; ".join(problems))


def t5_config(model: Transformer) -> dict:
    """config.json of T5ForConditionalGeneration holding the model."""
    c, table = model.config, model.encoder.score_bias       # T5Bias: the stacks' alike
    tied = c.tie_embeddings == "all"
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
        "vocab_size": c.tgt_vocab_size, "d_model": c.d_model, "d_kv": c.head_dim,
        "d_ff": c.d_ff, "num_layers": c.num_encoder_layers,
        "num_decoder_layers": c.num_decoder_layers, "num_heads": c.num_heads,
        "relative_attention_num_buckets": table.num_buckets,
        "relative_attention_max_distance": table.max_distance,
        "dropout_rate": c.dropout, "layer_norm_epsilon": c.layer_norm_eps,
        "feed_forward_proj": FEED_FORWARD[c.activation, c.gated_ffn],
        "is_encoder_decoder": True, "n_positions": c.max_positions,
        "pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "decoder_start_token_id": BOS_ID,
        "tie_word_embeddings": tied, "scale_decoder_outputs": tied, "dtype": "float32"}


def t5_weights(model: Transformer) -> dict[str, Tensor]:
    """Our float32 weights under T5's names (the tied matrix stored once, as shared)."""
    c = model.config
    state = {"shared.weight": model.encoder.embed.embedding.weight}
    if c.tie_embeddings == "embeddings":
        state["lm_head.weight"] = model.output_proj.weight
    for stack, layers in (("encoder", model.encoder.layers), ("decoder", model.decoder.layers)):
        module = getattr(model, stack)
        state[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = \
            module.score_bias.table.weight
        for i, layer in enumerate(layers):
            state.update(_block(layer, stack, f"{stack}.block.{i}.layer", c.head_dim))
        state[f"{stack}.final_layer_norm.weight"] = module.final_norm.weight
    if c.tie_embeddings == "all":     # T5 scales its last states by d_model^-0.5 then
        state["decoder.final_layer_norm.weight"] = \
            state["decoder.final_layer_norm.weight"] * math.sqrt(c.d_model)
    return {name: tensor.detach().float().contiguous() for name, tensor in state.items()}


def _block(layer, stack: str, prefix: str, head_dim: int) -> dict[str, Tensor]:
    """One layer of `stack` (its block N's prefix): self-attention, (a decoder's)
    cross-attention, feed-forward."""
    state = {}
    for n, (name, ours, norm) in enumerate(SUBLAYERS[stack]):
        attention = getattr(layer, ours)
        state[f"{prefix}.{n}.{name}.q.weight"] = attention.q_proj.weight / math.sqrt(head_dim)
        state[f"{prefix}.{n}.{name}.k.weight"] = attention.k_proj.weight
        state[f"{prefix}.{n}.{name}.v.weight"] = attention.v_proj.weight
        state[f"{prefix}.{n}.{name}.o.weight"] = attention.out_proj.weight
        state[f"{prefix}.{n}.layer_norm.weight"] = getattr(layer, norm).weight
    n, ffn = len(SUBLAYERS[stack]), layer.ffn
    dense = f"{prefix}.{n}.DenseReluDense"
    if ffn.linear3 is not None:        # act(x wi_0) * (x wi_1)
        state[f"{dense}.wi_0.weight"], state[f"{dense}.wi_1.weight"] = \
            ffn.linear1.weight, ffn.linear3.weight
    else:
        state[f"{dense}.wi.weight"] = ffn.linear1.weight
    state[f"{dense}.wo.weight"] = ffn.linear2.weight
    state[f"{prefix}.{n}.layer_norm.weight"] = getattr(layer, FFN_NORM[stack]).weight
    return state


def _generation_config(model: Transformer):
    """`generate`'s defaults: our search's (beam 4, length penalty 0.6), outputs up to the
    model's positions, and the tokens never output suppressed, the log-probabilities
    renormalized over the others (as ours: a beam then ranks as ours does)."""
    from transformers import GenerationConfig

    bias = model.output_proj.bias
    never = [] if bias is None else (bias == NEVER_OUTPUT).nonzero().flatten().tolist()
    return GenerationConfig(
        decoder_start_token_id=BOS_ID, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        max_length=model.config.max_positions, num_beams=4, length_penalty=0.6,
        early_stopping=True, suppress_tokens=never or None, renormalize_logits=bool(never))


def export_hf_t5(directory: Path, model: Transformer, out: Path) -> Path:
    """Write OUT/ with config.json, generation_config.json, model.safetensors,
    MarianTokenizer's files over our SentencePiece model and spiece.model; loadable with
    AutoModelForSeq2SeqLM and AutoTokenizer."""
    check_exportable(model)
    tokenizer = Tokenizer(directory / checkpoint.TOKENIZER)
    with atomic.atomic_directory(out) as temporary:
        (temporary / "config.json").write_text(json.dumps(t5_config(model), indent=2) + "\n",
                                               encoding="utf-8")
        _generation_config(model).save_pretrained(temporary)
        weights = temporary / "model.safetensors"
        save_file(t5_weights(model), str(weights), metadata={"format": "pt"})
        atomic.open_permissions(weights)                   # written 0600
        write_marian_tokenizer(tokenizer, temporary, model.config.max_positions,
                               checkpoint.read_languages(directory),
                               {"extra_ids": 0})       # spiece.model's: no sentinels added
        shutil.copyfile(tokenizer.path, temporary / SPM_FILE)
        write_export_marker(temporary, "huggingface-t5", checkpoint.trained_steps(directory))
    return out
