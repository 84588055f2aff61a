"""Model configuration: one frozen dataclass, validated on construction, and named presets.

Every field maps one to one onto a CLI flag or a config-file key. The defaults are the
paper's (post-LN, sinusoidal positions, ReLU FFN, three-way tied embeddings); each
deviation is a named field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args

from transduce.errors import TransduceError

# "fairseq": fairseq's sinusoids ([sin | cos], counted from 2), as NLLB and M2M-100 add them.
Positional = Literal["sinusoidal", "learned", "rotary", "t5", "alibi", "fairseq",
                     "disentangled"]
Activation = Literal["relu", "gelu", "gelu-tanh", "silu"]
Norm = Literal["layer", "rms"]
RopeScaling = Literal["none", "linear", "llama3"]
Tying = Literal["all", "embeddings", "decoder", "none"]
AttentionImpl = Literal["naive", "sdpa", "flash", "triton"]
AttentionType = Literal["softmax", "linear", "sliding", "global", "strided"]
Architecture = Literal["transformer", "decoder", "encoder", "rnn-bahdanau", "rnn-luong"]
RnnCell = Literal["gru", "lstm"]
LuongScore = Literal["general", "dot"]
PoolerActivation = Literal["tanh", "relu", "gelu"]
ClassifierPooling = Literal["cls", "mean"]


class ConfigError(TransduceError, ValueError):
    """A configuration or an argument that cannot work; the message names the field or
    option and its allowed values."""


class ValidatedConfig:
    """What every configuration dataclass can do: copy with changes, and round-trip
    through a plain dict (config.json, TOML tables)."""

    def replace(self, **changes: Any):
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _check_bools(self) -> None:
        """A config file's "false" or 1 is not a switch: only true and false are."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", bool) and not isinstance(value, bool):
                raise ConfigError(f"{type(self).__name__}.{field.name}={value!r}: must be "
                                  f"true or false")

    def _check_floats_finite(self) -> None:
        """NaN and infinity pass every range check written as a comparison: refuse them."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{type(self).__name__}.{field.name}={value}: must be a "
                                  f"finite number")

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
        return cls(**values)


@dataclass(frozen=True)
class ModelConfig(ValidatedConfig):
    """Sizes and options of the encoder-decoder model.

    tie_embeddings: "all" shares one matrix between source embedding, target embedding
    and the pre-softmax projection (the paper, needs one shared vocabulary); "embeddings"
    shares one matrix between the two embeddings and gives the projection its own (T5
    v1.1's, Flan-T5's); "decoder" ties only the target embedding and the projection;
    "none" unties everything.
    head_size: the size of every attention head, when it is not d_model / num_heads
    (T5 v1.1 small: 6 heads of 64 in a model of 512): the queries, keys and values are
    num_heads * head_size wide and the output projection maps them back to d_model.
    None: d_model / num_heads, which must then divide.
    num_kv_heads: key/value heads of the decoder's self- and cross-attention (MHA when
    equal to num_heads, MQA when 1, GQA in between). The encoder always uses full
    multi-head attention: it runs once per source, so its keys are never cached.
    attention_type: the self-attention of both stacks. "softmax" is the paper's;
    "linear" replaces softmax by a positive feature map (elu + 1), linear in the length;
    "sliding" lets each token see only the attention_window tokens on either side
    (before it, in the decoder); "global" adds the first global_tokens tokens as keys
    of every query and as queries over every key (Longformer, BigBird); "strided" adds
    summary keys every attention_window positions (Sparse Transformer's fixed pattern).
    Cross-attention is always softmax attention.
    full_attention_layers: arch "decoder" or "encoder" with attention_type "sliding": the
    layers (counted from 0) that attend over the whole context instead, as softmax
    attention (Gemma 2 interleaves one in two, Gemma 3 one in six, ModernBERT's encoder
    one in three): only their KV caches grow with the context.
    local_rope_base: with full_attention_layers, the rotary base of the sliding layers,
    unscaled (Gemma 3's 10,000 against its full layers' 1,000,000, which rope_scaling
    stretches); None: the same rotary positions on every layer.
    attention_softcap: arch "decoder": each attention score s (scaled) becomes
    cap * tanh(s / cap) before the mask and softmax, so that no score passes cap (Gemma
    2's 50); the scores are then written out (the naive kernel's form, whatever
    attention_impl says, but flash and triton, which refuse it).
    logit_softcap: arch "decoder": the output logits l become cap * tanh(l / cap) (Gemma
    2's 30).
    positional "disentangled": arch "encoder": DeBERTa's relative positions (He et al.
    2021), a table of 2 * position_buckets vectors shared by the layers (after a norm),
    which each layer's query and key projections turn into content-to-position and
    position-to-content terms of its scores, all over sqrt(3 d_k); distances count
    exactly within position_buckets / 2 and logarithmically wider up to
    max_relative_positions (None: max_positions), then share the last bucket
    (attention/disentangled.py). No position enters the embeddings, and the scores are
    written out: attention_impl "sdpa" or "naive".
    attention_scale=False drops the
    1/sqrt(d_k) of every attention's scores (an experiment of the lab, not a model to use).
    arch: "transformer" (the encoder-decoder), "decoder" (decoder-only, GPT: the
    decoder's layers without cross-attention, num_decoder_layers of them, over
    tgt_vocab_size, which must equal src_vocab_size), "encoder" (encoder-only, BERT:
    num_encoder_layers encoder layers over src_vocab_size, with segment embeddings,
    an embedding LayerNorm, the pooler and the pre-training heads), or an RNN
    encoder-decoder with
    Bahdanau (additive) or Luong attention; the RNNs use d_model, the layer
    counts, dropout, rnn_cell and the embedding fields, and ignore the attention and
    position fields. luong_score: arch "rnn-luong": "general" (q^T W k) or "dot" (q^T k);
    input_feeding: arch "rnn-luong": the previous step's attentional vector joins the
    decoder's input (Luong et al., section 3.3).
    activation: the FFN's; "gelu" is exact (erf) GELU, "gelu-tanh" its tanh
    approximation (GPT-2's), "silu" x * sigmoid(x) (swish, Marian's).
    gated_ffn: the FFN's gated linear unit form (Shazeer 2020): act(x W1) * (x W3), then
    W2; with "silu", SwiGLU (Llama's, Mistral's).
    norm: "layer" (LayerNorm, the paper's) or "rms" (RMSNorm, Zhang & Sennrich 2019:
    x / rms(x) * g, no centring and no bias; Llama's) for every norm of the model.
    norm_bias: norm "layer": every LayerNorm adds a bias after its gain (ModernBERT's
    have none).
    first_attention_norm: arch "encoder" with norm_first: False leaves out the first
    layer's norm before self-attention, which then reads the embedding norm's output as
    it is (ModernBERT's layer 0).
    sandwich_norm: pre-norm layers (norm_first) whose sub-layers' outputs pass through a
    norm of their own too before they join the residual stream (Ding et al. 2021's
    sandwich LayerNorm; Gemma 2 and 3's post-attention and post-feedforward norms).
    qkv_bias: the query, key and value projections have biases even where bias is False
    (Qwen2's layout: only those three).
    attention_bias: False: the attention's four projections (query, key, value, output)
    have no biases, while bias gives the feed-forward networks theirs (GPT-J's and
    CodeGen's layers).
    qk_norm: every attention normalizes each head's queries and keys with a norm of
    the model's kind over head_dim (one weight for all heads), before rotary positions:
    Qwen3's layout, a guard against growing attention logits (Henry et al. 2020;
    Dehghani et al. 2023).
    qk_norm_across_heads: with qk_norm, arch "decoder": one norm over all of a position's
    query heads together (num_heads * head_dim features), and one over its key heads, in
    place of one over each head (OLMo 2's).
    qk_norm_per_head: with qk_norm, arch "decoder": each head's norm of its queries, and
    of its keys, has a gain of its own and no bias (StableLM 2 12B's), in place of one
    gain shared by the heads.
    input_norms: False, arch "decoder" with sandwich_norm: each sub-layer reads x as it is
    and only its output is normalized before the residual sum, x + Norm(Sublayer(x))
    (OLMo 2's); the stack keeps its final norm.
    rotary_dims: positional "rotary": rotate only this many of each head's features (an
    even number; GPT-NeoX's and Pythia's rotary_pct of 0.25, Phi's
    partial_rotary_factor), the others carrying no position; None: all of them. Features
    i and i + head_dim / 2 form a pair as in full rotary positions, and the first
    rotary_dims / 2 pairs turn at rates base^(-2i / rotary_dims), the others not at all
    (an imported model's query and key features are put in that order: importers).
    parallel_residual: arch "decoder", pre-norm: each layer adds its attention and its
    feed-forward network, each after its own norm, to the same input, x + Attn(Norm1(x))
    + FFN(Norm3(x)), instead of one after the other (GPT-NeoX's and Pythia's).
    shared_norm: with parallel_residual, the feed-forward network reads the attention's
    norm, x + Attn(Norm1(x)) + FFN(Norm1(x)): one norm per layer (Phi-1, 1.5 and 2's;
    GPT-J's), no Norm3.
    rope_scaling: rotary frequencies stretched for a longer context: "linear" divides
    them all by rope_factor; "llama3" (Llama 3.1) divides those whose wavelength exceeds
    rope_original_positions / rope_low_freq_factor by rope_factor, keeps those below
    rope_original_positions / rope_high_freq_factor, and blends the ones between.
    output_bias: arch "transformer": the output projection adds a bias per token (the
    final_logits_bias of imported Marian models, hugely negative for tokens never to be
    output). It is fixed: training leaves it as imported, as transformers does. arch
    "decoder": a bias that trains with the rest (the lm_head bias of Phi-1, 1.5 and 2).
    scale_embeddings: multiply token embeddings by sqrt(d_model) (the paper); GPT-2 and
    BERT do not.
    embedding_norm: arch "transformer" or "decoder": each stack's input (token embedding
    and positions) passes through a norm before dropout (mBART's layernorm_embedding).
    type_vocab_size: arch "encoder": segment (token type) embeddings, 2 for BERT's
    sentence A / sentence B; 0 for none (DistilBERT's: a pair is told apart by its
    [SEP] alone, and segment ids are not read).
    pooler_activation: arch "encoder": what follows the pooler's dense layer, "tanh"
    (BERT's), "relu" (DistilBERT's pre_classifier) or "gelu" (exact; ELECTRA's
    classification head).
    embedding_size: arch "encoder": the token, position and segment embeddings' width
    where it is not d_model (ELECTRA-small's 128 under layers of 256): their norm is
    that wide, a projection then maps them to d_model, and the masked-LM head's dense
    layer maps back to it for the tied output (None: d_model, no projection).
    prediction_head: arch "encoder": every fine-tuning head reads through ModernBERT's
    prediction head, the pooler's dense layer, pooler_activation and a norm: the pooled
    state for classification, each token's state for tagging and answering (False:
    BERT's, the pooler's dense + activation for classification alone).
    classifier_pooling: arch "encoder": what the pooler reads, the first token's ([CLS])
    state ("cls", BERT's) or the mean of the real tokens' states ("mean", an option of
    ModernBERT's classifiers).
    The pooler's and the masked-LM head's dense layers have biases where bias is True.
    num_labels: arch "encoder": the sequence-classification head's classes (0: none).
    token_classifier: arch "encoder": that head labels each token (token classification:
    named entities, parts of speech) from its last hidden state, not the sequence from
    the pooled [CLS].
    question_answering: arch "encoder": that head (num_labels 2) gives each token a score
    of starting and of ending the answer to a question in the text read after it
    (extractive question answering: BERT's SQuAD head).
    """

    src_vocab_size: int = 37000
    tgt_vocab_size: int = 37000
    d_model: int = 512
    num_heads: int = 8
    num_kv_heads: int | None = None
    head_size: int | None = None
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation: Activation = "relu"
    gated_ffn: bool = False
    norm: Norm = "layer"
    qkv_bias: bool = False
    attention_bias: bool = True
    qk_norm: bool = False
    qk_norm_across_heads: bool = False
    qk_norm_per_head: bool = False
    norm_first: bool = False
    sandwich_norm: bool = False
    input_norms: bool = True
    parallel_residual: bool = False
    shared_norm: bool = False
    positional: Positional = "sinusoidal"
    max_positions: int = 1024
    rope_base: float = 10000.0
    rotary_dims: int | None = None
    rope_scaling: RopeScaling = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    position_buckets: int = 256
    max_relative_positions: int | None = None
    tie_embeddings: Tying = "all"
    attention_impl: AttentionImpl = "sdpa"
    bias: bool = True
    norm_bias: bool = True
    first_attention_norm: bool = True
    layer_norm_eps: float = 1e-5
    pad_id: int = 0
    attention_type: AttentionType = "softmax"
    attention_window: int = 16
    full_attention_layers: tuple[int, ...] = ()
    local_rope_base: float | None = None
    attention_softcap: float | None = None
    logit_softcap: float | None = None
    global_tokens: int = 1
    attention_scale: bool = True
    arch: Architecture = "transformer"
    rnn_cell: RnnCell = "gru"
    luong_score: LuongScore = "general"
    input_feeding: bool = False
    scale_embeddings: bool = True
    type_vocab_size: int = 2
    pooler_activation: PoolerActivation = "tanh"
    embedding_size: int | None = None
    prediction_head: bool = False
    classifier_pooling: ClassifierPooling = "cls"
    num_labels: int = 0
    token_classifier: bool = False
    question_answering: bool = False
    output_bias: bool = False
    embedding_norm: bool = False

    def __post_init__(self) -> None:
        self._check_bools()
        self._check_floats_finite()
        check_positive(self, "src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff",
                        "num_encoder_layers", "num_decoder_layers", "max_positions",
                        "attention_window", "global_tokens", "rope_original_positions")
        check_count(self, "num_labels", "type_vocab_size")
        check_choice(self, "activation")
        check_choice(self, "norm")
        check_choice(self, "rope_scaling")
        check_choice(self, "attention_type")
        check_choice(self, "arch")
        check_choice(self, "rnn_cell")
        check_choice(self, "luong_score")
        check_choice(self, "pooler_activation")
        check_choice(self, "classifier_pooling")
        check_choice(self, "positional")
        check_choice(self, "tie_embeddings")
        check_choice(self, "attention_impl")
        check_in_unit_interval(self, "dropout", "attention_dropout")
        for name in ("rope_base", "layer_norm_eps", "rope_factor", "rope_low_freq_factor"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name}={getattr(self, name)}: must be positive")
        if self.head_size is not None:
            check_positive(self, "head_size")
        elif self.d_model % self.num_heads:
            raise ConfigError(f"ModelConfig.d_model={self.d_model} is not divisible by "
                              f"num_heads={self.num_heads}; set head_size for heads of "
                              f"another size")
        kv_heads = self.kv_heads
        if kv_heads < 1 or self.num_heads % kv_heads:
            raise ConfigError(f"ModelConfig.num_kv_heads={self.num_kv_heads}: num_heads="
                              f"{self.num_heads} must be a positive multiple of it")
        if self.positional == "rotary" and self.head_dim % 2:
            raise ConfigError(f"ModelConfig.positional='rotary' needs an even head size, "
                              f"got {self.head_dim}")
        if self.rope_scaling != "none" and self.positional != "rotary":
            raise ConfigError(f"ModelConfig.rope_scaling={self.rope_scaling!r} scales rotary "
                              f"positions; positional={self.positional!r} has none")
        if self.rope_scaling == "llama3" and \
                not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(f"ModelConfig.rope_scaling='llama3' needs rope_high_freq_factor="
                              f"{self.rope_high_freq_factor} > rope_low_freq_factor="
                              f"{self.rope_low_freq_factor}")
        if self.positional == "rotary" and self.attention_type == "linear":
            raise ConfigError("ModelConfig.positional='rotary' does not combine with "
                              "attention_type='linear' (rotated features are no longer "
                              "positive); use sinusoidal or learned positions")
        if self.positional == "fairseq" and self.d_model < 4:
            raise ConfigError(f"ModelConfig.positional='fairseq' (NLLB's positions) needs "
                              f"d_model >= 4, got {self.d_model}")
        if self.positional in ("t5", "alibi") and self.attention_type != "softmax":
            raise ConfigError(f"ModelConfig.positional={self.positional!r} is a bias on the "
                              f"softmax scores and does not combine with attention_type="
                              f"{self.attention_type!r}")
        self._check_disentangled()
        if self.arch == "decoder" and self.attention_type in ("global", "strided"):
            raise ConfigError(f"ModelConfig.attention_type={self.attention_type!r} anchors its "
                              f"pattern at absolute positions, which left-padded prompts "
                              f"(arch='decoder') shift; use it with arch 'transformer' or "
                              f"'encoder'")
        self._check_layer_attention()
        self._check_softcaps()
        if self.sandwich_norm and not self.norm_first:
            raise ConfigError("ModelConfig.sandwich_norm=True adds norms to pre-norm layers; "
                              "set norm_first=True")
        self._check_partial_rotary()
        self._check_attention_bias()
        self._check_parallel_residual()
        self._check_olmo2_norms()
        if self.arch == "decoder" and self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError(f"ModelConfig.arch='decoder' has one vocabulary: "
                              f"src_vocab_size={self.src_vocab_size} must equal "
                              f"tgt_vocab_size={self.tgt_vocab_size}")
        if self.arch.startswith("rnn") and self.attention_type != "softmax":
            raise ConfigError(f"ModelConfig.attention_type={self.attention_type!r} applies to "
                              f"the Transformer's self-attention; arch={self.arch!r} has none")
        if self.arch.startswith("rnn") and (self.gated_ffn or self.norm != "layer"
                                            or self.qk_norm):
            field = "gated_ffn" if self.gated_ffn else "qk_norm" if self.qk_norm else "norm"
            raise ConfigError(f"ModelConfig.{field}={getattr(self, field)!r} applies to the "
                              f"Transformer's layers; arch={self.arch!r} has none")
        if self.arch != "rnn-luong" and (self.input_feeding or self.luong_score != "general"):
            field = "input_feeding" if self.input_feeding else "luong_score"
            raise ConfigError(f"ModelConfig.{field}={getattr(self, field)!r} applies to "
                              f"arch='rnn-luong', not arch={self.arch!r}")
        if self.arch.startswith("rnn") and self.d_model % 2:
            raise ConfigError(f"ModelConfig.d_model={self.d_model}: the RNN's bidirectional "
                              f"encoder needs an even size (d_model / 2 per direction)")
        if self.embedding_norm and self.arch not in ("transformer", "decoder"):
            raise ConfigError(f"ModelConfig.embedding_norm=True applies to arch='transformer' "
                              f"and 'decoder', not {self.arch!r}")
        for head in ("token_classifier", "question_answering"):
            if getattr(self, head) and self.arch != "encoder":
                raise ConfigError(f"ModelConfig.{head}=True applies to arch='encoder', not "
                                  f"arch={self.arch!r}")
        if self.question_answering and (self.token_classifier or self.num_labels != 2):
            raise ConfigError(f"ModelConfig.question_answering=True is a head of 2 outputs "
                              f"(start, end) over each token, not a token classifier: "
                              f"num_labels={self.num_labels}, "
                              f"token_classifier={self.token_classifier}")
        self._check_encoder_options()
        if self.output_bias and self.arch not in ("transformer", "decoder"):
            raise ConfigError(f"ModelConfig.output_bias=True applies to arch='transformer' "
                              f"and 'decoder', not arch={self.arch!r}")
        if self.tie_embeddings == "embeddings" and self.arch in ("decoder", "encoder"):
            raise ConfigError(f"ModelConfig.tie_embeddings='embeddings' shares the source "
                              f"and target embeddings of an encoder-decoder; arch="
                              f"{self.arch!r} has one embedding: use 'all' or 'none'")
        if self.tie_embeddings in ("all", "embeddings") and \
                self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError(
                f"ModelConfig.tie_embeddings={self.tie_embeddings!r} needs one shared "
                f"vocabulary, but "
                f"src_vocab_size={self.src_vocab_size} != tgt_vocab_size={self.tgt_vocab_size}; "
                f"use tie_embeddings='decoder' or 'none' for separate vocabularies")
        if not 0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size):
            raise ConfigError(f"ModelConfig.pad_id={self.pad_id} is outside the vocabulary")

    def _check_encoder_options(self) -> None:
        """The fields of an encoder-only model's heads and layers, and the norms' bias."""
        for name, default in (("pooler_activation", "tanh"), ("prediction_head", False),
                              ("classifier_pooling", "cls"), ("first_attention_norm", True)):
            if getattr(self, name) != default and self.arch != "encoder":
                raise ConfigError(f"ModelConfig.{name}={getattr(self, name)!r} applies to "
                                  f"arch='encoder', not arch={self.arch!r}")
        if self.embedding_size is not None:
            check_positive(self, "embedding_size")
            if self.arch != "encoder" or self.embedding_size == self.d_model:
                raise ConfigError(f"ModelConfig.embedding_size={self.embedding_size} sets an "
                                  f"encoder-only model's embeddings narrower or wider than "
                                  f"d_model={self.d_model} (arch={self.arch!r}); leave it "
                                  f"unset for embeddings of d_model")
        if not self.first_attention_norm and not self.norm_first:
            raise ConfigError("ModelConfig.first_attention_norm=False leaves out a pre-norm "
                              "layer's norm; set norm_first=True")
        if not self.norm_bias and self.norm != "layer":
            raise ConfigError(f"ModelConfig.norm_bias=False drops LayerNorm's bias; "
                              f"norm={self.norm!r} has none")

    def _check_disentangled(self) -> None:
        """DeBERTa's positions: an encoder-only model's softmax attention, written out,
        over distances bucketed up to relative_reach."""
        if self.positional != "disentangled":
            return
        name = "ModelConfig.positional='disentangled'"
        if self.arch != "encoder" or self.attention_type != "softmax":
            raise ConfigError(f"{name} (DeBERTa's) applies to arch='encoder' with "
                              f"attention_type='softmax', not arch={self.arch!r} and "
                              f"attention_type={self.attention_type!r}")
        if self.attention_impl not in ("sdpa", "naive"):
            raise ConfigError(f"{name} adds a bias to every score that depends on the "
                              f"content, which only the written-out kernels take: "
                              f"attention_impl 'sdpa' or 'naive', not {self.attention_impl!r}")
        if not isinstance(self.position_buckets, int) or isinstance(self.position_buckets, bool) \
                or self.position_buckets < 4 or self.position_buckets % 2:
            raise ConfigError(f"ModelConfig.position_buckets={self.position_buckets!r}: must "
                              f"be an even number of at least 4")
        reach = "max_relative_positions" if self.max_relative_positions is not None \
            else "max_positions"
        if not isinstance(self.relative_reach, int) or isinstance(self.relative_reach, bool) \
                or self.relative_reach <= self.position_buckets // 2 + 1:
            raise ConfigError(f"ModelConfig.{reach}={self.relative_reach!r}: the distance "
                              f"where the logarithmic buckets of positional='disentangled' "
                              f"end must exceed position_buckets / 2 + 1 = "
                              f"{self.position_buckets // 2 + 1}")

    def _check_layer_attention(self) -> None:
        """full_attention_layers: distinct layers of a decoder-only or encoder-only model's
        sliding stack; local_rope_base: their sliding layers' rotary positions."""
        layers = self.full_attention_layers
        if isinstance(layers, list):     # as config.json and TOML give it
            object.__setattr__(self, "full_attention_layers", layers := tuple(layers))
        name = f"ModelConfig.full_attention_layers={list(layers)!r}"
        if not isinstance(layers, tuple) or any(
                not isinstance(i, int) or isinstance(i, bool) for i in layers):
            raise ConfigError(f"{name}: must be a list of layer numbers")
        if layers and (self.arch not in ("decoder", "encoder")
                       or self.attention_type != "sliding"):
            raise ConfigError(f"{name} mixes full layers into a sliding stack: it needs "
                              f"arch 'decoder' or 'encoder' and attention_type='sliding', "
                              f"not arch={self.arch!r} and attention_type="
                              f"{self.attention_type!r}")
        stack = "num_encoder_layers" if self.arch == "encoder" else "num_decoder_layers"
        if list(layers) != sorted(set(layers)) or \
                any(not 0 <= i < getattr(self, stack) for i in layers):
            raise ConfigError(f"{name}: must be increasing layer numbers from 0 to "
                              f"{stack} - 1 = {getattr(self, stack) - 1}")
        if self.local_rope_base is None:
            return
        if not layers or self.positional != "rotary":
            raise ConfigError(f"ModelConfig.local_rope_base={self.local_rope_base} sets the "
                              f"rotary positions of sliding layers among full ones; it needs "
                              f"positional='rotary' and full_attention_layers")
        if not (isinstance(self.local_rope_base, (int, float)) and self.local_rope_base > 0):
            raise ConfigError(f"ModelConfig.local_rope_base={self.local_rope_base!r}: must "
                              f"be positive")

    def _check_partial_rotary(self) -> None:
        """rotary_dims: an even number of each head's features, of rotary positions."""
        dims = self.rotary_dims
        if dims is None:
            return
        name = f"ModelConfig.rotary_dims={dims!r}"
        if not isinstance(dims, int) or isinstance(dims, bool) or dims < 2 or dims % 2 \
                or dims > self.head_dim:
            raise ConfigError(f"{name}: must be an even number of a head's features, from "
                              f"2 to head_dim={self.head_dim}")
        if self.positional != "rotary":
            raise ConfigError(f"{name} rotates part of each head; positional="
                              f"{self.positional!r} has no rotary positions")

    def _check_attention_bias(self) -> None:
        """attention_bias=False takes the attention's biases from a model that has them."""
        if self.attention_bias:
            return
        if not self.bias or self.qkv_bias:
            raise ConfigError(f"ModelConfig.attention_bias=False drops the attention's "
                              f"biases where the rest of the model has them (bias=True, "
                              f"qkv_bias=False), not with bias={self.bias}, "
                              f"qkv_bias={self.qkv_bias}")
        if self.arch.startswith("rnn"):
            raise ConfigError(f"ModelConfig.attention_bias=False applies to the Transformer's "
                              f"attention, not arch={self.arch!r}")

    def _check_parallel_residual(self) -> None:
        """parallel_residual: a decoder-only model's pre-norm layers, without sandwich
        norms (no checkpoint has both)."""
        if self.shared_norm and not self.parallel_residual:
            raise ConfigError("ModelConfig.shared_norm=True lets a parallel layer's "
                              "feed-forward network read the attention's norm; set "
                              "parallel_residual=True")
        if not self.parallel_residual:
            return
        if self.arch != "decoder" or not self.norm_first or self.sandwich_norm:
            raise ConfigError(f"ModelConfig.parallel_residual=True sums a decoder-only "
                              f"model's attention and feed-forward network over one input: "
                              f"it needs arch='decoder' and norm_first=True without "
                              f"sandwich_norm, not arch={self.arch!r}, norm_first="
                              f"{self.norm_first}, sandwich_norm={self.sandwich_norm}")

    def _check_olmo2_norms(self) -> None:
        """qk_norm_across_heads and input_norms=False: a decoder-only model's (OLMo 2's),
        the first with qk_norm, the second with sandwich norms; qk_norm_per_head (StableLM
        2 12B's) with qk_norm over each head."""
        if self.qk_norm_across_heads and (self.arch != "decoder" or not self.qk_norm):
            raise ConfigError(f"ModelConfig.qk_norm_across_heads=True normalizes a decoder-only "
                              f"model's queries and keys over all heads: it needs "
                              f"arch='decoder' and qk_norm=True, not arch={self.arch!r}, "
                              f"qk_norm={self.qk_norm}")
        if self.qk_norm_per_head and (self.arch != "decoder" or not self.qk_norm
                                      or self.qk_norm_across_heads):
            raise ConfigError(f"ModelConfig.qk_norm_per_head=True gives each head of a "
                              f"decoder-only model its own norm of the queries and keys: it "
                              f"needs arch='decoder', qk_norm=True and not "
                              f"qk_norm_across_heads, not arch={self.arch!r}, qk_norm="
                              f"{self.qk_norm}, qk_norm_across_heads="
                              f"{self.qk_norm_across_heads}")
        if not self.input_norms and (self.arch != "decoder" or not self.sandwich_norm):
            raise ConfigError(f"ModelConfig.input_norms=False leaves a decoder-only model's "
                              f"sub-layers only their output norms: it needs arch='decoder' "
                              f"and sandwich_norm=True, not arch={self.arch!r}, "
                              f"sandwich_norm={self.sandwich_norm}")

    def _check_softcaps(self) -> None:
        """attention_softcap, logit_softcap: positive numbers, on a decoder-only model's
        softmax scores (written out: not the flash or triton kernels)."""
        for name in ("attention_softcap", "logit_softcap"):
            cap = getattr(self, name)
            if cap is None:
                continue
            if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
                raise ConfigError(f"ModelConfig.{name}={cap!r}: must be a positive number")
            if self.arch != "decoder":
                raise ConfigError(f"ModelConfig.{name}={cap} applies to arch='decoder', not "
                                  f"arch={self.arch!r}")
        if self.attention_softcap is None:
            return
        if self.attention_type not in ("softmax", "sliding"):
            raise ConfigError(f"ModelConfig.attention_softcap caps softmax scores; "
                              f"attention_type={self.attention_type!r} has none to cap")
        if self.attention_impl in ("flash", "triton"):
            raise ConfigError(f"ModelConfig.attention_softcap needs the scores written out: "
                              f"attention_impl 'sdpa' or 'naive', not "
                              f"{self.attention_impl!r}")

    def layer_attention_type(self, layer: int) -> AttentionType:
        """The self-attention of layer `layer` of the model's stack (full_attention_layers:
        softmax)."""
        return "softmax" if layer in self.full_attention_layers else self.attention_type

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads if self.head_size is None else self.head_size

    @property
    def embedding_width(self) -> int:
        """An encoder-only model's embeddings' width: embedding_size, else d_model."""
        return self.d_model if self.embedding_size is None else self.embedding_size

    @property
    def relative_reach(self) -> int:
        """Where disentangled positions' logarithmic buckets end: max_relative_positions,
        else max_positions."""
        return self.max_positions if self.max_relative_positions is None \
            else self.max_relative_positions

    @property
    def shares_embeddings(self) -> bool:
        """Whether one matrix embeds both sides (which then need one vocabulary)."""
        return self.tie_embeddings in ("all", "embeddings")

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the decoder attention (num_kv_heads resolved)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads



def check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{type(config).__name__}.{name}={value!r}: must be a positive integer")


def check_count(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{type(config).__name__}.{name}={value!r}: must be an integer "
                              f">= 0")


SEED_LIMIT = 2 ** 32     # what every generator seeded from it (torch, numpy) takes


def check_seed(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{name}={value!r}: must be an integer from 0 to {SEED_LIMIT - 1}")


def check_at_least(config: object, low: float, *names: str) -> None:
    for name in names:
        if getattr(config, name) < low:
            raise ConfigError(f"{type(config).__name__}.{name}={getattr(config, name)!r}: "
                              f"must be >= {low}")


def check_in_unit_interval(config: object, *names: str) -> None:
    """Values in [0, 1): dropout, smoothing, Adam's betas."""
    for name in names:
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{type(config).__name__}.{name}={value}: must be in [0, 1)")


def choices(literal: Any) -> tuple[str, ...]:
    """The values of a Literal type: the one list of choices, for validation and flags."""
    return get_args(literal)


@functools.cache
def field_types(config_type: type) -> dict[str, Any]:
    """A dataclass's fields' types, resolved from their annotations once per class
    (resolving them on each check cost every ModelConfig built 30 ms)."""
    return typing.get_type_hints(config_type)


def check_choice(config: object, name: str) -> None:
    """The field's value is one of its Literal type's values."""
    allowed = choices(field_types(type(config))[name])
    value = getattr(config, name)
    if value not in allowed:
        raise ConfigError(f"{type(config).__name__}.{name}={value!r}: choose one of "
                          f"{', '.join(allowed)}")


_GPT: dict[str, Any] = {"arch": "decoder", "norm_first": True, "positional": "learned",
                        "activation": "gelu-tanh", "scale_embeddings": False,
                        "max_positions": 1024, "num_encoder_layers": 1}

# Llama (Touvron et al. 2023): GPT's layout with RMSNorm, rotary positions, SwiGLU
# feed-forward networks and no biases.
_LLAMA: dict[str, Any] = {**_GPT, "positional": "rotary", "norm": "rms", "gated_ffn": True,
                          "activation": "silu", "bias": False, "layer_norm_eps": 1e-6}

_BERT: dict[str, Any] = {"arch": "encoder", "norm_first": False, "positional": "learned",
                         "activation": "gelu", "scale_embeddings": False,
                         "max_positions": 512, "num_decoder_layers": 1,
                         "attention_dropout": 0.1, "layer_norm_eps": 1e-12}

# ModernBERT (Warner et al. 2024): BERT's encoder with pre-norm layers of bias-free
# LayerNorms (the first without its attention norm), no biases, rotary positions (of
# base 160,000 in the full layers, 10,000 in the sliding ones), GeGLU feed-forward
# networks, windows of 64 tokens each side in all layers but one in three, no segments,
# and heads that read through a prediction head (dense, GELU, norm).
_MODERNBERT: dict[str, Any] = {
    **_BERT, "norm_first": True, "positional": "rotary", "gated_ffn": True, "bias": False,
    "norm_bias": False, "first_attention_norm": False, "type_vocab_size": 0,
    "layer_norm_eps": 1e-5, "dropout": 0.0, "attention_dropout": 0.0,
    "attention_type": "sliding", "attention_window": 64, "rope_base": 160_000.0,
    "local_rope_base": 10_000.0, "prediction_head": True, "pooler_activation": "gelu",
    "max_positions": 8192}

# DeBERTa-v3 (He et al. 2021, 2023): BERT's post-norm encoder with disentangled attention
# (relative positions in 256 buckets each side up to 512, no position table), no
# segments, LayerNorms of eps 1e-7, and a GELU after the pooler (its ContextPooler).
_DEBERTA: dict[str, Any] = {**_BERT, "positional": "disentangled", "type_vocab_size": 0,
                            "pooler_activation": "gelu", "layer_norm_eps": 1e-7,
                            "position_buckets": 256}

# The paper's two models (Table 3), and two sized for a 2-core CPU. small is pre-norm:
# at a CPU budget of minutes it learns several times faster than post-norm
# (docs/experiments.md); base and big keep the paper's post-norm layout.
PRESETS: dict[str, ModelConfig] = {
    "base": ModelConfig(),
    "big": ModelConfig(d_model=1024, num_heads=16, d_ff=4096, dropout=0.3),
    "small": ModelConfig(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                         num_decoder_layers=3, dropout=0.1, norm_first=True),
    "tiny": ModelConfig(d_model=64, num_heads=4, d_ff=128, num_encoder_layers=2,
                        num_decoder_layers=2, dropout=0.0, max_positions=256),
    # Decoder-only (GPT-2, Radford et al. 2019): pre-norm with a final LayerNorm, learned
    # positions, tanh-approximated GELU, no embedding scale, the output tied to the token
    # embeddings; 124M and 355M parameters at GPT-2's 50,257 byte-level BPE pieces.
    "gpt2": ModelConfig(**_GPT, src_vocab_size=50257, tgt_vocab_size=50257, d_model=768,
                        num_heads=12, d_ff=3072, num_decoder_layers=12),
    "gpt2-medium": ModelConfig(**_GPT, src_vocab_size=50257, tgt_vocab_size=50257,
                               d_model=1024, num_heads=16, d_ff=4096, num_decoder_layers=24),
    "gpt-small": ModelConfig(**{**_GPT, "max_positions": 512}, d_model=256, num_heads=4,
                             d_ff=1024, num_decoder_layers=4),
    # Encoder-only (BERT, Devlin et al. 2019): post-norm layers with exact GELU, learned
    # positions, segment embeddings and an embedding LayerNorm, no embedding scale; 110M
    # parameters at BERT's 30,522 WordPiece pieces.
    "bert-base": ModelConfig(**_BERT, src_vocab_size=30522, tgt_vocab_size=30522,
                             d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=12),
    "bert-small": ModelConfig(**{**_BERT, "max_positions": 256}, d_model=256, num_heads=4,
                              d_ff=1024, num_encoder_layers=4),
    "bert-tiny": ModelConfig(**{**_BERT, "max_positions": 128, "dropout": 0.0,
                                "attention_dropout": 0.0}, d_model=64, num_heads=4,
                             d_ff=128, num_encoder_layers=2),
    # 149M parameters with its masked-LM head at its 50,368 pieces (ModernBERT-base's).
    "modernbert-base": ModelConfig(**_MODERNBERT, src_vocab_size=50368, tgt_vocab_size=50368,
                                   d_model=768, num_heads=12, d_ff=1152,
                                   num_encoder_layers=22,
                                   full_attention_layers=tuple(range(0, 22, 3))),
    "modernbert-tiny": ModelConfig(**{**_MODERNBERT, "max_positions": 128,
                                      "attention_window": 8}, d_model=64, num_heads=4,
                                   d_ff=96, num_encoder_layers=3, full_attention_layers=(0,)),
    # 184M parameters at its 128,100 pieces, 98M of them the embeddings (DeBERTa-v3-base's).
    "deberta-v3-base": ModelConfig(**_DEBERTA, src_vocab_size=128100, tgt_vocab_size=128100,
                                   d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=12),
    "deberta-tiny": ModelConfig(**{**_DEBERTA, "max_positions": 64, "position_buckets": 16,
                                   "dropout": 0.0, "attention_dropout": 0.0}, d_model=64,
                                num_heads=4, d_ff=128, num_encoder_layers=2),
    "gpt-tiny": ModelConfig(**{**_GPT, "max_positions": 256, "dropout": 0.0}, d_model=64,
                            num_heads=4, d_ff=128, num_decoder_layers=2),
    # Llama-style decoders for a CPU budget: gpt-small's sizes with grouped-query
    # attention (2 key/value heads) and the SwiGLU width that keeps the FFN's weights
    # (3 * 704 ~ 2 * 1024); imported Llama and Mistral checkpoints start from llama-small.
    "llama-small": ModelConfig(**{**_LLAMA, "max_positions": 512}, d_model=256, num_heads=4,
                               num_kv_heads=2, d_ff=704, num_decoder_layers=4),
    "llama-tiny": ModelConfig(**{**_LLAMA, "max_positions": 256, "dropout": 0.0},
                              d_model=64, num_heads=4, num_kv_heads=2, d_ff=96,
                              num_decoder_layers=2),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset, with fields overridden (vocabulary sizes, say)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides)


Dtype = Literal["float32", "bfloat16"]
TrainDtype = Literal["auto", Dtype]
FrozenWeightDtype = Literal[Dtype, "int8", "nf4", "nf4-dq"]
Schedule = Literal["noam", "budget"]
Objective = Literal["mlm", "mlm,nsp"]
Task = Literal["pretrain", "classify", "tag", "answer"]


@dataclass(frozen=True)
class TrainConfig(ValidatedConfig):
    """The paper's recipe (section 5) and the run's budget.

    schedule "noam" (the paper): lr = lr_scale * d_model^-0.5 * min(step^-0.5,
    step * warmup_steps^-1.5). schedule "budget" (budgeted training, Li et al. 2020):
    the same peak, lr_scale * (d_model * warmup_steps)^-0.5, reached after
    warmup_fraction of the budget (max_minutes and/or max_steps), then a linear decay to
    0 at the budget's end. Adam with (adam_beta1, adam_beta2, adam_eps); label
    smoothing; batches of about max_tokens source and max_tokens target tokens,
    update_freq of them (per process) per step. ema_decay > 0 keeps an exponential
    moving average of the weights, written as RUN/ema when the run ends.
    pack_length > 0: batches of max_tokens // pack_length rows of that many tokens instead
    of whole lines batched by length. A language model (arch "decoder") trains on blocks
    cut across line boundaries from the stream of all training lines (GPT); a translation
    model (arch "transformer") on rows packed with whole pairs, each pair attending only
    to itself (data/packing.py): every batch the same shape, padding only at row ends.
    task and objective (arch "encoder", BERT; data/masking.py has the layouts): task
    "pretrain" trains on a text corpus with objective "mlm" (masked LM: [CLS] line [SEP])
    or "mlm,nsp" (masked LM + next sentence: [CLS] A [SEP] B [SEP], loss = mean MLM +
    mean NSP); task "classify" fine-tunes (or trains) a sequence classifier on a
    classification corpus ({split}.tsv), cross entropy on the pooled [CLS] state; task
    "tag" a token classifier (ModelConfig.token_classifier) on a tagging corpus
    ({split}.conll), cross entropy on each word's first piece; task "answer" a question
    answerer (ModelConfig.question_answering) on a question-answering corpus ({split}.json,
    SQuAD's layout), BERT's span loss over windows of max_len positions. The encoder's
    losses are not label-smoothed.
    fsdp (torchrun, two processes or more; train/sharding.py): each process holds 1/N of
    every weight, gradient and Adam moment (torch.distributed.fsdp.fully_shard, one unit
    per layer) instead of a full replica (DistributedDataParallel); checkpoints keep the
    full format.
    """

    max_steps: int = 0                 # 0: no step limit
    max_minutes: float = 0.0           # 0: no time limit
    max_tokens: int = 4096
    update_freq: int = 1
    warmup_steps: int = 4000
    lr_scale: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1
    clip_norm: float = 0.0             # 0: no gradient clipping
    dtype: TrainDtype = "auto"         # bfloat16: autocast, float32 master weights; auto:
    #                                    bfloat16 where the hardware has bfloat16 units
    compile: bool = False
    cuda_graphs: bool = False          # with compile and pack_length, on one CUDA GPU: each
    #                                    step's forward and backward replayed as CUDA graphs
    fsdp: bool = False                 # under torchrun: shard weights, gradients and Adam
    #                                    state across the processes (FSDP) instead of DDP
    seed: int = 1
    max_len: int = 256                 # longer pairs are filtered from training, with a count
    log_every: int = 20
    eval_every: int = 500
    save_every: int = 500
    keep_last: int = 5
    dev_bleu_sentences: int = 0        # >0: greedy dev BLEU on that many sentences per eval
    nan_limit: int = 5                 # abort after this many non-finite losses in a row
    threads: int = 0                   # 0: torch's default
    schedule_offset: int = 0           # noam starts this many steps in (uptraining)
    schedule: Schedule = "noam"
    warmup_fraction: float = 0.05      # schedule "budget": warmup as a fraction of the budget
    ema_decay: float = 0.0             # 0: no moving average of the weights
    pack_length: int = 0               # >0: train on packed rows of this many tokens
    task: Task = "pretrain"            # arch encoder: "pretrain" (text), "classify" (tsv),
                                       # "tag" (conll) or "answer" (SQuAD json)
    objective: Objective = "mlm"       # arch encoder, task pretrain: "mlm" or "mlm,nsp"
    source_lang: str = ""              # a multilingual model's (NLLB's): the corpus's source
    target_lang: str = ""              # and target language codes ("": a one-pair model)
    lora_rank: int = 0                 # >0 (with --init): train low-rank adapters of this
    #                                    rank beside frozen weights (model/lora.py)
    lora_alpha: float = 16.0           # the adapters' update is scaled by alpha / rank
    lora_targets: str = "q,k,v,o,ffn"  # the layers adapted: attention q, k, v, o; ffn
    lora_dropout: float = 0.0          # dropout on the adapters' input
    lora_base_dtype: FrozenWeightDtype = "float32"  # the adapted layers' frozen weights kept
    #   in bfloat16 (half their memory; with --dtype bfloat16), or quantized: int8 (a
    #   quarter), nf4 (QLoRA's 4 bits, 14%) or nf4-dq (its scales in 8 bits too, 12.9%),
    #   dequantized for each product

    def __post_init__(self) -> None:
        self._check_bools()
        self._check_floats_finite()
        check_positive(self, "max_tokens", "update_freq", "warmup_steps", "max_len",
                        "log_every", "eval_every", "save_every", "keep_last", "nan_limit")
        check_choice(self, "dtype")
        check_choice(self, "schedule")
        check_choice(self, "task")
        check_choice(self, "objective")
        check_in_unit_interval(self, "warmup_fraction", "ema_decay")
        if self.schedule == "budget" and not (self.max_steps or self.max_minutes):
            raise ConfigError("TrainConfig.schedule='budget' decays to 0 at the end of the "
                              "budget: give max_steps or max_minutes")
        check_at_least(self, 0, "max_steps", "max_minutes", "clip_norm", "dev_bleu_sentences",
                       "threads", "schedule_offset", "pack_length", "lora_rank")
        self._check_lora()
        self._check_cuda_graphs()
        check_in_unit_interval(self, "label_smoothing", "adam_beta1", "adam_beta2")
        check_seed(self.seed, "TrainConfig.seed")
        for name in ("source_lang", "target_lang"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"TrainConfig.{name}={getattr(self, name)!r}: must be a "
                                  f"language code (a string)")
        if bool(self.source_lang) != bool(self.target_lang):
            raise ConfigError(f"TrainConfig.source_lang={self.source_lang!r}, target_lang="
                              f"{self.target_lang!r}: a multilingual model trains on a pair; "
                              f"give both codes or neither")
        for name in ("lr_scale", "adam_eps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"TrainConfig.{name}={getattr(self, name)}: must be positive")

    def _check_cuda_graphs(self) -> None:
        """CUDA graphs replay one shape, from the compiler's one graph a step, and hand
        the gradients over in the graphs' own memory, which the next step's replay
        overwrites: so compile, pack_length, one batch a step, and no FSDP."""
        if not self.cuda_graphs:
            return
        needs = [(not self.compile, "compile (--compile)"),
                 (not self.pack_length, "one shape a batch (--pack-length L)"),
                 (self.update_freq != 1, "one batch a step (--update-freq 1: the graphs' "
                                         "gradients would be overwritten by the next batch's)"),
                 (self.fsdp, "no sharding (--no-fsdp)")]
        missing = [need for lacking, need in needs if lacking]
        if missing:
            raise ConfigError("TrainConfig.cuda_graphs needs " + "; ".join(missing))

    def _check_lora(self) -> None:
        parse_lora_targets(self.lora_targets, "TrainConfig.lora_targets")
        if self.lora_alpha <= 0:
            raise ConfigError(f"TrainConfig.lora_alpha={self.lora_alpha}: must be positive")
        check_in_unit_interval(self, "lora_dropout")
        check_choice(self, "lora_base_dtype")
        if self.lora_base_dtype != "float32" and not self.lora_rank:
            raise ConfigError(f"TrainConfig.lora_base_dtype={self.lora_base_dtype!r} keeps a "
                              f"LoRA run's frozen weights: give lora_rank (--lora-rank)")


# What TrainConfig.lora_targets names (model/lora.py: the layers each stands for).
LORA_TARGETS = ("q", "k", "v", "o", "ffn")


def parse_lora_targets(text: str, option: str = "--lora-targets") -> tuple[str, ...]:
    """"q,v" -> ("q", "v"); an unknown or repeated name is a ConfigError naming it."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in LORA_TARGETS]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(f"{option}={text!r}: a comma-separated list of distinct names "
                          f"among {', '.join(LORA_TARGETS)}"
                          + (f" ({', '.join(unknown)} is not one)" if unknown else ""))
    return names


# small's budget recipe without label smoothing, for the small language models.
_SMALL_LM_RECIPE: dict[str, Any] = {"max_tokens": 2048, "schedule": "budget",
                                   "warmup_fraction": 0.3, "warmup_steps": 400,
                                   "lr_scale": 0.7, "ema_decay": 0.999, "label_smoothing": 0.0}

# What a preset trains with unless a config file or flags say otherwise. base and big keep
# the paper's recipe (TrainConfig's defaults); small has the budget recipe chosen on dev
# BLEU after 5 and 20 minutes on 2 CPU cores (docs/experiments.md, "A budget recipe").
# Its warmup and decay are fractions of the budget, so a slower machine still ends
# training with the rate decayed rather than mid-warmup.
TRAIN_RECIPES: dict[str, dict[str, Any]] = {
    "small": {"max_tokens": 2048, "schedule": "budget", "warmup_fraction": 0.3,
              "warmup_steps": 400, "lr_scale": 0.7, "ema_decay": 0.999},
    # The same budget schedule for the small language models, without label smoothing:
    # a language model is judged by its perplexity, which smoothing raises. Llama's
    # layout at gpt-small's size trains with the same recipe, so that the two compare at
    # one budget (docs/experiments.md, "GPT-2's layout against Llama's").
    "gpt-small": _SMALL_LM_RECIPE,
    "llama-small": _SMALL_LM_RECIPE,
    # The same for the small encoder (masked LM; its losses are never smoothed), at a
    # lower peak: post-norm BERT stalls at the unigram loss where pre-norm GPT trains.
    "bert-small": {"max_tokens": 2048, "schedule": "budget", "warmup_fraction": 0.3,
                   "warmup_steps": 400, "lr_scale": 0.5, "ema_decay": 0.999,
                   "label_smoothing": 0.0},
}


def train_recipe(preset_name: str) -> dict[str, Any]:
    """The TrainConfig fields the preset trains with (empty: the paper's defaults)."""
    return dict(TRAIN_RECIPES.get(preset_name, {}))
