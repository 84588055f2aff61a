"""Hugging Face ModernBERT (ModernBertModel, ModernBertForMaskedLM,
...ForSequenceClassification, ...ForTokenClassification and ...ForQuestionAnswering
directories) -> our EncoderOnly.

ModernBERT (Warner et al. 2024) is BERT's encoder rebuilt: pre-norm layers of LayerNorms
without biases (layer 0 reads the embedding norm without one of its own), no biases in
the projections, rotary positions instead of a table, GeGLU feed-forward networks,
sliding-window attention (local_attention / 2 tokens each side) in all layers but one
in global_attn_every_n_layers, with its own rotary base, and a final norm. Every head
reads through a prediction head (dense, GELU, norm). Each is a field of ModelConfig
(model/encoder_only.py), and the weights map one to one but two, which are split:

    embeddings.tok_embeddings       encoder.embed.embedding (and the tied MLM output)
    embeddings.norm                 encoder.embed.norm
    layers.N.attn_norm              encoder.layers.N.norm1 (layer 0 has none)
    layers.N.attn.Wqkv              encoder.layers.N.self_attn.q_proj, k_proj, v_proj
                                    (its rows, in three)
    layers.N.attn.Wo                encoder.layers.N.self_attn.out_proj
    layers.N.mlp_norm               encoder.layers.N.norm2
    layers.N.mlp.Wi                 encoder.layers.N.ffn.linear1 (its first d_ff rows:
                                    GELU's input), ffn.linear3 (the rest: the gate)
    layers.N.mlp.Wo                 encoder.layers.N.ffn.linear2
    final_norm                      encoder.final_norm
    head.dense, head.norm           mlm_head.dense, .norm (a masked LM's); pooler,
                                    pooler_norm (a classifier's, tagger's, answerer's)
    decoder.bias                    mlm_head.decoder.bias (the weight: tied)
    classifier                      classifier

The task models keep the encoder under "model.". The tokenizer is tokenizer.json's
(byte-level BPE, [CLS] A [SEP] B [SEP]), as import hf-bert reads it.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor

from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.answer_windows import SPAN_LABELS
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_tied_copy, check_type_and_fixed_options, refuse_unread, take_weight, \
    unprefixed_names
from transduce.importers.hf_bert import QUESTION_ANSWERING, TOKEN_CLASSIFIER, _labels, \
    check_task, read_tokenizer, save_import, token_task, with_tokenizer
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json, read_weights
from transduce.importers.hf_llama import required_field
from transduce.importers.sentence_transformers import read_sentence_embedding
from transduce.model.encoder_only import EncoderOnly

MODEL_TYPES = ("modernbert",)
NAME = "hf-modernbert"
# ModernBertConfig's defaults where config.json leaves a key out.
DEFAULT_THETAS = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
THETA_KEYS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
LAYER_TYPES = ("full_attention", "sliding_attention")
# hidden_activation -> ModelConfig.activation; classifier_activation -> pooler_activation.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh",
               "silu": "silu", "swish": "silu", "relu": "relu"}
POOLER_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "tanh": "tanh"}
# The three projections' biases are one field of ours.
BIASES = ("attention_bias", "mlp_bias", "classifier_bias")


def import_modernbert(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face ModernBERT directory (config.json, model.safetensors or
    pytorch_model.bin, tokenizer.json) and write it as our checkpoint at `out`,
    replacing one there, as import_bert does (fresh heads listed in the origin)."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    check_type_and_fixed_options(hf, config_file, MODEL_TYPES, {})
    check_task(hf, config_file)                   # a multiple-choice model is refused
    tokenizer = read_tokenizer(hf_dir)
    sentence_embedding = read_sentence_embedding(hf_dir)
    tensors, source = read_weights(hf_dir)
    names = unprefixed_names(tensors, "model.", source)
    task = token_task(hf)
    labels = _labels(hf, config_file) if "classifier.weight" in names else None
    if task == QUESTION_ANSWERING and labels is not None:
        labels = list(SPAN_LABELS)
    config = model_config(hf, config_file, tokenizer, len(labels) if labels else 0,
                          task if labels else None)
    masked_lm = "decoder.bias" in names or "decoder.weight" in names
    if masked_lm:
        _check_masked_lm_head(hf, config_file)
    state, found = map_weights(tensors, names, config, source, masked_lm)
    del tensors          # the stored files are let go before the save copies the model
    return save_import(EncoderOnly(config), state, found, out, tokenizer,
                       origin={"imported": NAME, "from": str(hf_dir.resolve())},
                       labels=labels, sentence_embedding=sentence_embedding, has_nsp=False)


def _check_masked_lm_head(hf: dict[str, Any], config_file: Path) -> None:
    """A masked-LM head's activation (classifier_activation) is the layers' (ours
    computes hidden_activation there, as BERT's head does)."""
    head, layers = hf.get("classifier_activation", "gelu"), hf.get("hidden_activation", "gelu")
    if head != layers:
        raise ForeignCheckpointError(
            f"{config_file}: classifier_activation={head!r} differs from hidden_activation="
            f"{layers!r}; our masked-LM head computes the layers' activation")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 num_labels: int, task: str | None) -> ModelConfig:
    """The "modernbert-base" preset with the sizes and options of a ModernBertConfig."""
    required = partial(required_field, hf, config_file)

    biases = {key: hf.get(key, False) for key in BIASES}
    if len(set(biases.values())) > 1:
        raise ForeignCheckpointError(f"{config_file}: {biases}: ours has biases in all three "
                                     f"or in none")
    activation = _choice(hf, config_file, "hidden_activation", ACTIVATIONS)
    pooler = _choice(hf, config_file, "classifier_activation", POOLER_ACTIVATIONS)
    layers = required("num_hidden_layers")
    kinds = layer_types(hf, config_file, layers)
    full = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    sliding = len(full) < layers
    global_base, local_base = (rope_theta(hf, config_file, kind) for kind in LAYER_TYPES)
    vocab_size = required("vocab_size")
    try:
        config = preset(
            "modernbert-base", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
            d_model=required("hidden_size"), num_heads=required("num_attention_heads"),
            num_encoder_layers=layers, d_ff=required("intermediate_size"),
            max_positions=hf.get("max_position_embeddings", 8192), activation=activation,
            bias=biases["attention_bias"], norm_bias=hf.get("norm_bias", False),
            layer_norm_eps=hf.get("norm_eps", 1e-5),
            dropout=max(hf.get(key, 0.0) for key in ("embedding_dropout", "mlp_dropout",
                                                     "classifier_dropout")),
            attention_dropout=hf.get("attention_dropout", 0.0),
            attention_type="sliding" if sliding else "softmax",
            attention_window=hf.get("local_attention", 128) // 2,
            full_attention_layers=full if sliding else (),
            rope_base=global_base if full else local_base,
            local_rope_base=local_base if sliding and full and local_base != global_base
            else None,
            pooler_activation=pooler, classifier_pooling=hf.get("classifier_pooling", "cls"),
            num_labels=num_labels, token_classifier=task == TOKEN_CLASSIFIER,
            question_answering=task == QUESTION_ANSWERING)
        return with_tokenizer(config, hf, config_file, tokenizer)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None


def layer_types(hf: dict[str, Any], config_file: Path, layers: int) -> list[str]:
    """Each layer's attention: layer_types where config.json lists them (transformers 5
    writes them), else one full layer in global_attn_every_n_layers, from layer 0."""
    kinds = hf.get("layer_types")
    if kinds is None:
        every = hf.get("global_attn_every_n_layers", 3)
        if not isinstance(every, int) or every < 1:
            raise ForeignCheckpointError(f"{config_file}: global_attn_every_n_layers={every!r}"
                                         f": must be a positive integer")
        return ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or \
            any(kind not in LAYER_TYPES for kind in kinds):
        raise ForeignCheckpointError(f"{config_file}: layer_types must list {layers} of "
                                     f"{' and '.join(map(repr, LAYER_TYPES))}, got {kinds!r}")
    return kinds


def rope_theta(hf: dict[str, Any], config_file: Path, kind: str) -> float:
    """The rotary base of `kind`'s layers: rope_parameters[kind] (transformers 5), else
    global_rope_theta / local_rope_theta; rotary positions unscaled."""
    parameters = (hf.get("rope_parameters") or {}).get(kind) or {}
    if parameters.get("rope_type", "default") != "default":
        raise ForeignCheckpointError(f"{config_file}: rope_parameters[{kind!r}] rope_type="
                                     f"{parameters['rope_type']!r} is not supported (only "
                                     f"'default': unscaled rotary positions)")
    theta = parameters.get("rope_theta", hf.get(THETA_KEYS[kind], DEFAULT_THETAS[kind]))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ForeignCheckpointError(f"{config_file}: the rotary base of {kind} layers, "
                                     f"{theta!r}, must be a positive number")
    return float(theta)


def _choice(hf: dict[str, Any], config_file: Path, key: str, ours: dict[str, str]) -> str:
    value = hf.get(key, "gelu")
    if value not in ours:
        raise ForeignCheckpointError(f"{config_file}: {key}={value!r} is not supported "
                                     f"(choose one of {', '.join(ours)})")
    return ours[value]


def map_weights(tensors: dict[str, Tensor], names: dict[str, str], config: ModelConfig,
                source: Path, masked_lm: bool) -> tuple[dict[str, Tensor], set[str]]:
    """ModernBERT's tensors -> (our state dict in float32, without the heads the
    checkpoint lacks; the heads it has). Each key accounted for, each shape checked."""
    c, v = config.d_model, config.src_vocab_size
    state: dict[str, Tensor] = {}

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    def linear(ours: str, theirs: str, n_in: int, n_out: int) -> None:
        state[f"{ours}.weight"] = take(f"{theirs}.weight", n_out, n_in)
        if config.bias:
            state[f"{ours}.bias"] = take(f"{theirs}.bias", n_out)

    def norm(ours: str, theirs: str) -> None:
        state[f"{ours}.weight"] = take(f"{theirs}.weight", c)
        if config.norm_bias:
            state[f"{ours}.bias"] = take(f"{theirs}.bias", c)

    embedding = take("embeddings.tok_embeddings.weight", v, c)
    state |= {"encoder.embed.embedding.weight": embedding, "mlm_head.decoder.weight": embedding}
    norm("encoder.embed.norm", "embeddings.norm")
    for i in range(config.num_encoder_layers):
        _layer(state, take, linear, norm, config, i)
    norm("encoder.final_norm", "final_norm")
    found: set[str] = set()
    if any(name.startswith("head.") for name in names):
        if masked_lm:
            linear("mlm_head.dense", "head.dense", c, c)
            norm("mlm_head.norm", "head.norm")
        else:
            linear("pooler", "head.dense", c, c)
            norm("pooler_norm", "head.norm")
        found.add("mlm_head" if masked_lm else "pooler")
    if masked_lm:
        state["mlm_head.decoder.bias"] = take("decoder.bias", v) if "decoder.bias" in names \
            else embedding.new_zeros(v)                               # decoder_bias False
        check_tied_copy(tensors, names, source, "decoder.weight", embedding,
                        "embeddings.tok_embeddings.weight",
                        "only tied output embeddings can be imported")
        found.add("mlm_head")
    if config.num_labels:
        linear_with_bias = {"weight": (config.num_labels, c), "bias": (config.num_labels,)}
        for part, shape in linear_with_bias.items():      # a bias whatever classifier_bias
            state[f"classifier.{part}"] = take(f"classifier.{part}", *shape)
        found.add("classifier")
    refuse_unread(names, source)
    return state, found


def _layer(state, take, linear, norm, config: ModelConfig, i: int) -> None:
    """Layer i's weights: Wqkv's and Wi's rows split, layer 0 without an attention norm."""
    c, ff = config.d_model, config.d_ff
    ours, theirs = f"encoder.layers.{i}", f"layers.{i}"
    qkv = take(f"{theirs}.attn.Wqkv.weight", 3 * c, c)
    qkv_bias = take(f"{theirs}.attn.Wqkv.bias", 3 * c) if config.bias else None
    for j, projection in enumerate(("q_proj", "k_proj", "v_proj")):
        state[f"{ours}.self_attn.{projection}.weight"] = qkv[j * c:(j + 1) * c]
        if qkv_bias is not None:
            state[f"{ours}.self_attn.{projection}.bias"] = qkv_bias[j * c:(j + 1) * c]
    linear(f"{ours}.self_attn.out_proj", f"{theirs}.attn.Wo", c, c)
    if i > 0:
        norm(f"{ours}.norm1", f"{theirs}.attn_norm")
    norm(f"{ours}.norm2", f"{theirs}.mlp_norm")
    wi = take(f"{theirs}.mlp.Wi.weight", 2 * ff, c)
    state[f"{ours}.ffn.linear1.weight"], state[f"{ours}.ffn.linear3.weight"] = wi[:ff], wi[ff:]
    if config.bias:
        wi_bias = take(f"{theirs}.mlp.Wi.bias", 2 * ff)
        state[f"{ours}.ffn.linear1.bias"], state[f"{ours}.ffn.linear3.bias"] = \
            wi_bias[:ff], wi_bias[ff:]
    linear(f"{ours}.ffn.linear2", f"{theirs}.mlp.Wo", ff, c)

