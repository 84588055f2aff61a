"""Where our LoRA adapters sit in Hugging Face's models, as PEFT names them: each of a
language model's adapted layers is a module of LlamaForCausalLM (Mistral's and Qwen2's
names are Llama's), of GPT2LMHeadModel, whose c_attn holds q, k and v in one Conv1D, or
of BloomForCausalLM, whose query_key_value holds them head by head (each head's query,
key and value rows together), of GPTNeoXForCausalLM (the same way), StableLmForCausalLM
(Llama's names), PhiForCausalLM or GPTJForCausalLM, whose query and key rows are each
head's in their rotary order (positional.heads_in_rotary_order: an update's rows are
reordered as the weight's);
an encoder's, a module of BERT's, RoBERTa's or DistilBERT's layers (bert. or roberta.
before encoder.layer.N.attention.self.query, .key, .value, attention.output.dense,
intermediate.dense, output.dense; distilbert. before transformer.layer.N.attention.q_lin,
.k_lin, .v_lin, .out_lin, ffn.lin1, ffn.lin2; model. before ModernBERT's
layers.N.attn.Wqkv, which holds q, k and v, attn.Wo, mlp.Wi, which holds linear1 and
linear3, and mlp.Wo: encoder_names.py); an encoder-decoder's,
a module of the model `export hf` writes (translation_family): BART's names for Marian,
Pegasus, NLLB (M2M100) and mBART, T5's.

    ours (decoder.layers.N.)  Llama (model.layers.N.)   GPT-2 (transformer.h.N.)
                              (Phi-3: q, k, v in self_attn.qkv_proj, gate and up in
                              mlp.gate_up_proj, each a part of its rows)
    self_attn.q_proj          self_attn.q_proj          attn.c_attn, its first third
    self_attn.out_proj        self_attn.o_proj          attn.c_proj
    ffn.linear1               mlp.gate_proj             mlp.c_fc
    ffn.linear3               mlp.up_proj               -
    ffn.linear2               mlp.down_proj             mlp.c_proj

    ours (decoder.layers.N.)  BLOOM (transformer.h.N.)   GPT-NeoX (gpt_neox.layers.N.)
    self_attn.q_proj          self_attention.query_key_value, attention.query_key_value,
                              rows (H, 3, D)[:, 0]       rows (H, 3, D)[:, 0]
    self_attn.out_proj        self_attention.dense      attention.dense
    ffn.linear1, linear2      mlp.dense_h_to_4h, mlp.dense_4h_to_h (both)

    ours (decoder.layers.N.)  Phi (model.layers.N.)          GPT-J (transformer.h.N.)
    self_attn.q_proj          self_attn.q_proj (and k, v)    attn.q_proj (and k, v)
    self_attn.out_proj        self_attn.dense                attn.out_proj
    ffn.linear1, linear2      mlp.fc1, mlp.fc2               mlp.fc_in, mlp.fc_out

    ours ({stack}.layers.N.)  BART (model.{stack}.layers.N.)  T5 ({stack}.block.N.)
    self_attn.q_proj          self_attn.q_proj                layer.0.SelfAttention.q
    self_attn.out_proj        self_attn.out_proj              layer.0.SelfAttention.o
    cross_attn.q_proj         encoder_attn.q_proj             layer.1.EncDecAttention.q
    ffn.linear1               fc1                             layer.F.DenseReluDense.wi(_0)
    ffn.linear3               -                               layer.F.DenseReluDense.wi_1
    ffn.linear2               fc2                             layer.F.DenseReluDense.wo

(F: 1 in T5's encoder, 2 in its decoder.) An adapter's matrices keep their shapes in
either (A (r, in), B (out, r), a Conv1D's weight being the transpose of ours); PEFT's file
names them "base_model.model.<module>.lora_A.weight" and "...lora_B.weight". Two exports
change a weight, and an adapter's update changes with it (Place): Marian's and Pegasus's
permute the model dimension (their sinusoids' sines first), the columns of a matrix that
reads the residual stream and the rows of one that writes it; T5's divides each query
projection by sqrt(d_kv), since T5 does not scale its scores.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from transduce.config import ModelConfig
from transduce.importers.encoder_names import encoder_names
from transduce.model.positional import sines_first_permutation

PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.((?:self|cross)_attn\.[qkv]_proj|"
                    r"(?:self|cross)_attn\.out_proj|ffn\.linear[123])$")
LLAMA_NAMES = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
               "self_attn.v_proj": "self_attn.v_proj", "self_attn.out_proj": "self_attn.o_proj",
               "ffn.linear1": "mlp.gate_proj", "ffn.linear3": "mlp.up_proj",
               "ffn.linear2": "mlp.down_proj"}
GPT2_NAMES = {"self_attn.out_proj": "attn.c_proj", "ffn.linear1": "mlp.c_fc",
              "ffn.linear2": "mlp.c_proj"}
GPT2_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")   # c_attn's parts
BLOOM_NAMES = {"self_attn.out_proj": "self_attention.dense", "ffn.linear1": "mlp.dense_h_to_4h",
               "ffn.linear2": "mlp.dense_4h_to_h"}
NEOX_NAMES = {"self_attn.out_proj": "attention.dense", "ffn.linear1": "mlp.dense_h_to_4h",
              "ffn.linear2": "mlp.dense_4h_to_h"}
PHI_NAMES = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
             "self_attn.v_proj": "self_attn.v_proj", "self_attn.out_proj": "self_attn.dense",
             "ffn.linear1": "mlp.fc1", "ffn.linear2": "mlp.fc2"}
GPTJ_NAMES = {"self_attn.q_proj": "attn.q_proj", "self_attn.k_proj": "attn.k_proj",
              "self_attn.v_proj": "attn.v_proj", "self_attn.out_proj": "attn.out_proj",
              "ffn.linear1": "mlp.fc_in", "ffn.linear2": "mlp.fc_out"}
ROTARY_ROWS = ("self_attn.q_proj", "self_attn.k_proj")
FUSED_QKV = ("c_attn", "query_key_value", "Wqkv")     # the modules that hold q, k and v
FUSED_GATE = ("Wi",)            # ModernBERT's: the feed-forward input and gate (linear1, 3)
BART_NAMES = {"self_attn": "self_attn", "cross_attn": "encoder_attn", "q_proj": "q_proj",
              "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "out_proj",
              "ffn.linear1": "fc1", "ffn.linear2": "fc2"}
T5_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "o"}
T5_ATTENTION = {"self_attn": "0.SelfAttention", "cross_attn": "1.EncDecAttention"}
T5_FEED_FORWARD = {"linear1": "wi", "linear3": "wi_1", "linear2": "wo"}   # gated: wi_0, wi_1
# Our layers whose input, or output, is the model dimension.
READS_RESIDUAL = ("q_proj", "k_proj", "v_proj", "linear1", "linear3")
WRITES_RESIDUAL = ("out_proj", "linear2")


@dataclass(frozen=True)
class Place:
    """A Hugging Face module, and which of its output parts one of our layers is (GPT-2's
    c_attn: q, k, v in that order; every other module is one part, 0); whether the layer
    reads or writes the model dimension, which an export may permute (residual_order);
    the factor their weight carries over ours (T5's queries: d_kv^-0.5); and whether
    its rows are each head's in the format's rotary order (rotary_rows: GPT-NeoX's,
    StableLM's, Phi's and GPT-J's queries and keys; rotary_pairs: GPT-J's, whose rotated
    pairs are adjacent)."""

    module: str
    part: int = 0
    reads_residual: bool = False
    writes_residual: bool = False
    weight_scale: float = 1.0
    rotary_rows: bool = False
    rotary_pairs: bool = False


def is_gpt2_layout(config: ModelConfig) -> bool:
    """Our language models export as GPT-2 with a position table, as Llama with rotary
    positions, as BLOOM with ALiBi's."""
    return config.positional not in ("rotary", "alibi")


def is_bloom_layout(config: ModelConfig) -> bool:
    return config.arch == "decoder" and config.positional == "alibi"


def is_gpt_neox_layout(config: ModelConfig) -> bool:
    """Our language models that export as GPT-NeoX, StableLM or Phi
    (export/hf_decoder.decoder_family, neox_family): rotary positions with LayerNorms, on
    part of each head, parallel residuals or an output bias."""
    return config.arch == "decoder" and config.positional == "rotary" and (
        config.norm == "layer" or config.parallel_residual or config.rotary_dims is not None
        or config.output_bias)


def neox_family(config: ModelConfig) -> str:
    """Which format holds a language model of that layout (is_gpt_neox_layout): "gptj"
    for attention without biases, "stablelm" for gated feed-forward networks (one after
    the attention, or parallel over one norm: StableLM 2 12B's), "phi" for the other
    parallel residuals over one norm or an output bias, "gpt_neox" for the rest."""
    if not config.attention_bias:
        return "gptj"
    if config.gated_ffn:
        return "stablelm"
    return "phi" if config.shared_norm or config.output_bias else "gpt_neox"


def fused_rows(config: ModelConfig, module: str) -> Tensor | None:
    """perm, with a fused q, k, v module's rows = [q; k; v][perm], where they are not in
    that order: BLOOM's and GPT-NeoX's query_key_value, head by head; None elsewhere."""
    if not ((is_bloom_layout(config) or is_gpt_neox_layout(config))
            and module.endswith("query_key_value")):
        return None
    heads, size = config.num_heads, config.head_dim
    return torch.arange(3 * heads * size).reshape(3, heads, size).transpose(0, 1).reshape(-1)


def translation_family(config: ModelConfig) -> str:
    """The transformers model `export hf` writes an encoder-decoder as (export/hf.py): T5
    for T5's relative positions, M2M100 (NLLB's) for fairseq's sinusoids, mBART for a
    norm of the embeddings (its names BART's, its dimension kept), else BART's family
    (Marian post-norm, Pegasus pre-norm), whose sinusoids put the sines first."""
    if config.embedding_norm:
        return "mbart"
    return {"t5": "t5", "fairseq": "m2m100"}.get(config.positional, "bart")


def residual_order(config: ModelConfig) -> Tensor | None:
    """perm, with their model-dimension vector = ours[perm], where the export permutes
    that dimension (Marian's and Pegasus's); None where it keeps it."""
    if config.arch == "transformer" and translation_family(config) == "bart":
        return sines_first_permutation(config.d_model)
    return None


def is_adaptable(name: str) -> bool:
    """Whether our module of this name is a layer's attention or feed-forward matrix."""
    return _LAYER.match(name) is not None


def place_of(config: ModelConfig, layer: str) -> Place:
    """Our adapted layer's name -> its place in the Hugging Face model; ValueError for a
    layer that has none (not a layer's attention or feed-forward matrix)."""
    found = _LAYER.match(layer)
    if found is None:
        raise ValueError(f"{layer}: not a layer's attention or feed-forward matrix")
    stack, index, ours = found.groups()
    if config.arch == "transformer":
        return _translation_place(config, layer, stack, int(index), ours)
    if ours.startswith("cross_attn."):
        raise ValueError(f"{layer}: a {config.arch!r} model has no cross-attention")
    if stack == "encoder":
        names = encoder_names(config)
        if ours not in names.layer:
            raise ValueError(f"{layer}: BERT's feed-forward network has no third matrix")
        return Place(f"{names.prefix}{names.layer_module(int(index), ours)}",
                     names.parts.get(ours, 0))
    if is_bloom_layout(config):
        return _bloom_place(layer, int(index), ours)
    if is_gpt_neox_layout(config):
        return _neox_place(config, layer, int(index), ours)
    if not is_gpt2_layout(config):
        return Place(f"model.layers.{index}.{LLAMA_NAMES[ours]}")
    if ours in GPT2_QKV:
        return Place(f"transformer.h.{index}.attn.c_attn", GPT2_QKV.index(ours))
    if ours not in GPT2_NAMES:
        raise ValueError(f"{layer}: GPT-2's feed-forward network has no third matrix")
    return Place(f"transformer.h.{index}.{GPT2_NAMES[ours]}")


def _bloom_place(layer: str, index: int, ours: str) -> Place:
    if ours in GPT2_QKV:
        return Place(f"transformer.h.{index}.self_attention.query_key_value",
                     GPT2_QKV.index(ours))
    if ours not in BLOOM_NAMES:
        raise ValueError(f"{layer}: BLOOM's feed-forward network has no third matrix")
    return Place(f"transformer.h.{index}.{BLOOM_NAMES[ours]}")


def _neox_place(config: ModelConfig, layer: str, index: int, ours: str) -> Place:
    """GPT-NeoX's (q, k, v fused head by head), StableLM's (Llama's names), Phi's or
    GPT-J's."""
    family = neox_family(config)
    rotary = ours in ROTARY_ROWS
    if family == "gpt_neox" and ours in GPT2_QKV:
        return Place(f"gpt_neox.layers.{index}.attention.query_key_value",
                     GPT2_QKV.index(ours), rotary_rows=rotary)
    prefix, names = {"gpt_neox": ("gpt_neox.layers", NEOX_NAMES),
                     "stablelm": ("model.layers", LLAMA_NAMES),
                     "phi": ("model.layers", PHI_NAMES),
                     "gptj": ("transformer.h", GPTJ_NAMES)}[family]
    if ours not in names:
        name = {"gpt_neox": "GPT-NeoX", "phi": "Phi", "gptj": "GPT-J"}[family]
        raise ValueError(f"{layer}: {name}'s feed-forward network has no third matrix")
    return Place(f"{prefix}.{index}.{names[ours]}", rotary_rows=rotary,
                 rotary_pairs=rotary and family == "gptj")


def _translation_place(config: ModelConfig, layer: str, stack: str, index: int, ours: str
                       ) -> Place:
    """Where `export hf` puts this layer of an encoder-decoder."""
    module, _, matrix = ours.rpartition(".")
    residual = {"reads_residual": matrix in READS_RESIDUAL,
                "writes_residual": matrix in WRITES_RESIDUAL}
    if translation_family(config) != "t5":
        if ours == "ffn.linear3":
            raise ValueError(f"{layer}: BART's feed-forward network has no third matrix")
        name = BART_NAMES[ours] if module == "ffn" else \
            f"{BART_NAMES[module]}.{BART_NAMES[matrix]}"
        return Place(f"model.{stack}.layers.{index}.{name}", **residual)
    block = f"{stack}.block.{index}.layer"
    if module != "ffn":
        scale = 1 / math.sqrt(config.head_dim) if matrix == "q_proj" else 1.0
        return Place(f"{block}.{T5_ATTENTION[module]}.{T5_NAMES[matrix]}", weight_scale=scale,
                     **residual)
    dense = f"{block}.{1 if stack == 'encoder' else 2}.DenseReluDense"
    name = "wi_0" if matrix == "linear1" and config.gated_ffn else T5_FEED_FORWARD[matrix]
    return Place(f"{dense}.{name}", **residual)


# Phi-3's fused modules in Llama's layout: our layer -> (its fused module, its part there)
PHI3_FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0),
              "self_attn.k_proj": ("self_attn.qkv_proj", 1),
              "self_attn.v_proj": ("self_attn.qkv_proj", 2),
              "ffn.linear1": ("mlp.gate_up_proj", 0), "ffn.linear3": ("mlp.gate_up_proj", 1)}


def fused_place_of(config: ModelConfig, layer: str) -> Place | None:
    """Where Phi-3 holds this layer of a language model in Llama's layout: a part of its
    fused qkv_proj or gate_up_proj (an import splits them, so an adapter on one is
    split the same way); None for a layer it holds alone or another layout's."""
    found = _LAYER.match(layer)
    if found is None or config.arch != "decoder" or is_gpt2_layout(config) \
            or is_bloom_layout(config) or is_gpt_neox_layout(config):
        return None
    _, index, ours = found.groups()
    if ours not in PHI3_FUSED:
        return None
    module, part = PHI3_FUSED[ours]
    return Place(f"model.layers.{index}.{module}", part)


def fused_sizes(config: ModelConfig, module: str) -> tuple[int, ...] | None:
    """The output sizes of a fused module's parts, in row order (q, k, v; or linear1 and
    linear3), or None for a module that holds one of our layers."""
    if module.endswith(FUSED_QKV):
        return qkv_sizes(config)
    if module.endswith(FUSED_GATE):
        return config.d_ff, config.d_ff
    return None


def qkv_sizes(config: ModelConfig) -> tuple[int, int, int]:
    """The output sizes of a fused module's parts (GPT-2's c_attn, BLOOM's
    query_key_value): q, k, v."""
    kv = config.kv_heads * config.head_dim
    return config.num_heads * config.head_dim, kv, kv
