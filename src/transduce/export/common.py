"""What every export shares: its error, the library it writes with, and the models no
format here can hold."""

from __future__ import annotations

import importlib

from transduce.config import ModelConfig
from transduce.errors import TransduceError


class ExportError(TransduceError, ValueError):
    """The model has a feature the target format cannot express, or the library that
    writes the format is missing; names it."""


def require(library: str, command: str) -> None:
    """The library an export writes with (transformers, ctranslate2: the `export` extra,
    not the core install), or an ExportError that says how to install it."""
    try:
        importlib.import_module(library)
    except ImportError as error:
        raise ExportError(f"{command} writes with {library}, which cannot be imported "
                          f"({error}): pip install 'transduce[export]'") from None


def not_a_plain_transformer(c: ModelConfig, arch: str = "transformer", *,
                            sliding: bool = False, any_head_size: bool = False,
                            score_bias: tuple[str, ...] = (), qk_norm: bool = False,
                            mixed: bool = False, gemma: bool = False,
                            softcap: bool = False, embedding_norm: bool = False,
                            modernbert: bool = False,
                            projected_embeddings: bool = False,
                            neox: bool = False, olmo2: bool = False,
                            phi: bool = False, attention_bias: bool = False,
                            qk_norm_per_head: bool = False) -> list[str]:
    """What no format here can hold: another shape than the format's `arch` (RNN
    models among them), non-softmax self-attention (sliding-window softmax attention
    where the format masks it: `sliding`), score biases (but those of `score_bias`:
    "t5"), heads of another size than d_model / num_heads (unless the format has a
    field for it: `any_head_size`) and norms of the queries and keys (unless it has
    them: `qk_norm`), sliding layers mixed with full ones (unless the format lists each
    layer's kind: `mixed`, or is Gemma 3's) and sandwich norms (unless the format is
    Gemma 3's: `gemma`), soft-capped scores or logits (unless the format caps them:
    `softcap`), a norm of each stack's input (unless the format has one:
    `embedding_norm`), ModernBERT's LayerNorms without biases, first layer without an
    attention norm and heads (unless the format holds them: `modernbert`), and
    embeddings of another width than d_model, projected (unless the format projects
    them: `projected_embeddings`, ELECTRA's), and parallel residuals or rotary positions
    on part of each head (unless the format has them: `neox`, GPT-NeoX's), and norms on
    the sub-layers' outputs alone or of the queries and keys over all heads (unless the
    format has them: `olmo2`), a parallel layer's one norm or a language model's
    output bias (unless the format has them: `phi`), attention without the biases the
    rest of the model has (unless the format's is: `attention_bias`, GPT-J's), and norms
    of the queries and keys with a gain per head (unless the format has them:
    `qk_norm_per_head`, StableLM's)."""
    problems = [] if modernbert else _modernbert_fields(c)
    if c.embedding_size is not None and not projected_embeddings:
        problems.append(f"embedding_size={c.embedding_size} (the format embeds at d_model="
                        f"{c.d_model})")
    if c.embedding_norm and not embedding_norm:
        problems.append("embedding_norm=True (the format has no norm of the embeddings)")
    if c.arch != arch:
        problems.append(f"arch={c.arch!r} (the format holds arch {arch!r})")
    if c.attention_type not in (("softmax", "sliding") if sliding else ("softmax",)):
        problems.append(f"attention_type={c.attention_type!r} (the format has softmax attention)")
    if not c.attention_scale:
        problems.append("attention_scale=False (the format scales the scores)")
    if c.positional in ("t5", "alibi") and c.positional not in score_bias:
        problems.append(f"positional={c.positional!r} (the format has no score bias)")
    if c.head_size is not None and not any_head_size and c.head_size * c.num_heads != c.d_model:
        problems.append(f"head_size={c.head_size} (the format's heads are d_model / "
                        f"num_heads = {c.d_model / c.num_heads:g} wide)")
    if c.qk_norm and not qk_norm:
        problems.append("qk_norm=True (the format has no norms of the queries and keys)")
    if not softcap:
        problems += [f"{name}={getattr(c, name)} (the format does not soft-cap them)"
                     for name in ("attention_softcap", "logit_softcap")
                     if getattr(c, name) is not None]
    if c.full_attention_layers and not (mixed or gemma):
        problems.append(f"full_attention_layers={list(c.full_attention_layers)} (the format's "
                        f"layers share one attention type)")
    if c.sandwich_norm and not gemma:
        problems.append("sandwich_norm=True (the format has no norms on the sub-layers' "
                        "outputs)")
    if c.parallel_residual and not neox:
        problems.append("parallel_residual=True (the format's layers add their sub-layers "
                        "one after the other)")
    if c.rotary_dims is not None and not neox:
        problems.append(f"rotary_dims={c.rotary_dims} (the format turns every feature of a "
                        f"head)")
    if not phi:
        if c.shared_norm:
            problems.append("shared_norm=True (the format's parallel layers have a norm "
                            "for each sub-layer)")
        if c.output_bias and c.arch == "decoder":
            problems.append("output_bias=True (the format's output has no bias)")
    if c.qk_norm_per_head and not qk_norm_per_head:
        problems.append("qk_norm_per_head=True (the format's norms of the queries and keys "
                        "share one gain across heads)")
    if not c.attention_bias and not attention_bias:
        problems.append("attention_bias=False (the format's attention has biases where the "
                        "rest of the model has them)")
    if not olmo2:
        if not c.input_norms:
            problems.append("input_norms=False (the format normalizes each sub-layer's "
                            "input)")
        if c.qk_norm_across_heads:
            problems.append("qk_norm_across_heads=True (the format normalizes each head's "
                            "queries and keys, if any)")
    return problems


def fixed_layout_problems(c: ModelConfig, family: str, layout: dict, activations: dict,
                          scalings: tuple[str, ...] = ("none", "linear")) -> list[str]:
    """What a transformers language model of a fixed layout (GPT-NeoX's, StableLM's,
    OLMo 2's) refuses beyond not_a_plain_transformer's: fields of other values than
    `layout`'s, post-norm layers, scaled embeddings, heads other than d_model /
    num_heads wide, a rotary scaling not among `scalings`, an activation it lacks."""
    problems = [f"{name}={getattr(c, name)!r} (the format's is {value!r})"
                for name, value in layout.items() if getattr(c, name) != value]
    if not c.norm_first:
        problems.append("norm_first=False (the format's layers are pre-norm)")
    if c.scale_embeddings:
        problems.append("scale_embeddings=True (the format does not scale embeddings)")
    if c.head_size is not None and c.head_size * c.num_heads != c.d_model:
        problems.append(f"head_size={c.head_size} ({family}'s heads are d_model / num_heads "
                        f"wide)")
    if c.rope_scaling not in scalings:
        problems.append(f"rope_scaling={c.rope_scaling!r} (not one {family} reads here)")
    if c.activation not in activations:
        problems.append(f"activation={c.activation!r} (not one of {sorted(activations)})")
    return problems


def _modernbert_fields(c: ModelConfig) -> list[str]:
    """ModernBERT's fields that a config sets, in the words of a refusal."""
    problems = []
    if not c.norm_bias:
        problems.append("norm_bias=False (the format's LayerNorms have biases)")
    if not c.first_attention_norm:
        problems.append("first_attention_norm=False (the format's first layer has its norm)")
    if c.prediction_head:
        problems.append("prediction_head=True (the format has no norm in its heads)")
    if c.classifier_pooling != "cls":
        problems.append(f"classifier_pooling={c.classifier_pooling!r} (the format pools the "
                        f"first token)")
    return problems


def not_the_papers_layers(c: ModelConfig) -> list[str]:
    """What the encoder-decoder formats' layers lack: RMSNorm and gated feed-forward
    networks (Llama's, which the decoder-only export holds)."""
    problems = []
    if c.norm != "layer":
        problems.append(f"norm={c.norm!r} (the format has LayerNorm)")
    if c.gated_ffn:
        problems.append("gated_ffn=True (the format's feed-forward network has two matrices)")
    return problems
