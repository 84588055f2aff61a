"""Hugging Face DeBERTa-v2 and -v3 (model_type "deberta-v2": DebertaV2Model,
...ForMaskedLM, ...ForSequenceClassification, ...ForTokenClassification and
...ForQuestionAnswering directories) -> our EncoderOnly.

DeBERTa (He et al. 2021; v3, He et al. 2023) is BERT's post-norm encoder with
disentangled attention: no position table, and scores that add content-to-position and
position-to-content terms read from a table of relative positions every layer shares
(positional "disentangled", attention/disentangled.py). The weights are named as BERT's
(hf_bert.py) under "deberta.", but for these:

    encoder.layer.N.attention.self.query_proj   encoder.layers.N.self_attn.q_proj
                                                (key_proj, value_proj alike)
    encoder.rel_embeddings                      encoder.relative_positions.embedding
    encoder.LayerNorm                           encoder.relative_positions.norm
    pooler.dense                                pooler, GELU after it (pooler_hidden_act)
    lm_predictions.lm_head.dense, .LayerNorm    mlm_head.dense, .norm
    lm_predictions.lm_head.bias                 mlm_head.decoder.bias (the weight: tied)

A masked LM's head is under those names (config.json's legacy false) or under BERT's,
cls.predictions.* (legacy true). The pre-trained checkpoints' replaced-token-detection head (mask_predictions) is left
unread and named in the origin ("dropped_heads"). Refused by name: DeBERTa v1
(model_type "deberta"), a position table added to the embeddings, unbucketed relative
positions, position projections of their own (share_att_key false), one of the two
position terms alone, the convolution after the first layer (conv_kernel_size:
DeBERTa-v2-xlarge's), embeddings narrower than the layers, a multiple-choice head.

The tokenizer is tokenizer.json's; a directory with spm.model alone (microsoft's
releases) has it converted by transformers' DebertaV2TokenizerFast, as transformers
itself converts it on loading.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.answer_windows import SPAN_LABELS
from transduce.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_type_and_fixed_options, take_weight
from transduce.importers import encoder_names
from transduce.importers.hf_bert import ACTIVATIONS, QUESTION_ANSWERING, TOKEN_CLASSIFIER, \
    TOKEN_HEADS, EncoderFamily, _bert_names, _labels, _without_dropped, check_task, \
    map_weights, read_tokenizer, save_import, token_task, with_tokenizer
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json, read_weights
from transduce.importers.hf_llama import required_field
from transduce.importers.sentence_transformers import read_sentence_embedding
from transduce.model.encoder_only import EncoderOnly

MODEL_TYPES = ("deberta-v2",)
NAME = "hf-deberta"
SPM_MODEL = "spm.model"
# What our disentangled attention computes: key -> (DebertaV2Config's default, ours).
LAYOUT = {"relative_attention": (False, True), "position_biased_input": (True, False),
          "share_att_key": (False, True), "norm_rel_ebd": ("none", "layer_norm"),
          "conv_kernel_size": (0, 0)}
POSITION_TERMS = {"c2p", "p2c"}
POOLER_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "tanh": "tanh"}
# DeBERTa's own masked-LM head names -> BERT's (config.json's legacy: false).
MLM_NAMES = {"lm_predictions.lm_head.dense": "cls.predictions.transform.dense",
             "lm_predictions.lm_head.LayerNorm": "cls.predictions.transform.LayerNorm",
             "lm_predictions.lm_head.bias": "cls.predictions.bias"}


def import_deberta(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face DeBERTa-v2/v3 directory (config.json, model.safetensors or
    pytorch_model.bin, tokenizer.json or spm.model) and write it as our checkpoint at
    `out`, replacing one there, as import_bert does (fresh and dropped heads listed in
    the origin)."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    check_type_and_fixed_options(hf, config_file, MODEL_TYPES, {})
    check_layout(hf, config_file)
    check_task(hf, config_file)                   # a multiple-choice model is refused
    tokenizer = read_deberta_tokenizer(hf_dir)
    sentence_embedding = read_sentence_embedding(hf_dir)
    tensors, source = read_weights(hf_dir)
    names, dropped = _without_dropped(_deberta_names(tensors, source), DEBERTA.dropped)
    task = token_task(hf)
    family = DEBERTA if task is None else replace(DEBERTA, classifier=TOKEN_HEADS[task])
    labels = _labels(hf, config_file) if f"{family.classifier}.weight" in names else None
    if task == QUESTION_ANSWERING and labels is not None:
        labels = list(SPAN_LABELS)
    config = model_config(hf, config_file, tokenizer, len(labels) if labels else 0,
                          task if labels else None)
    state = relative_positions(tensors, names, config, source)
    layers, found = map_weights(tensors, names, config, source, family)
    del tensors          # the stored files are let go before the save copies the model
    return save_import(EncoderOnly(config), state | layers, found, out, tokenizer,
                       origin={"imported": NAME, "from": str(hf_dir.resolve())},
                       labels=labels, sentence_embedding=sentence_embedding, has_nsp=False,
                       dropped=dropped)


def check_layout(hf: dict[str, Any], config_file: Path) -> None:
    """A DeBERTa of v3's layout, which ours computes (see the module note)."""
    for key, (default, ours) in LAYOUT.items():
        if hf.get(key, default) != ours:
            raise ForeignCheckpointError(
                f"{config_file}: {key}={hf.get(key, default)!r} is not supported (ours "
                f"computes DeBERTa-v3's layout, {key}={ours!r})")
    terms = hf.get("pos_att_type") or []
    terms = terms.split("|") if isinstance(terms, str) else terms
    if not isinstance(terms, list) or set(terms) != POSITION_TERMS:
        raise ForeignCheckpointError(f"{config_file}: pos_att_type={hf.get('pos_att_type')!r}"
                                     f": ours adds both position terms, ['p2c', 'c2p']")
    if not isinstance(hf.get("position_buckets"), int) or hf["position_buckets"] <= 0:
        raise ForeignCheckpointError(f"{config_file}: position_buckets="
                                     f"{hf.get('position_buckets')!r}: ours buckets relative "
                                     f"positions logarithmically (a positive count)")
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    head = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads \
        else None
    widths = {"embedding_size": hidden, "pooler_hidden_size": hidden,
              "attention_head_size": head}
    for key, expected in widths.items():
        if hf.get(key) is not None and hf[key] != expected:
            raise ForeignCheckpointError(f"{config_file}: {key}={hf[key]} where the layers' "
                                         f"gives {expected}: not supported")


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 num_labels: int, task: str | None) -> ModelConfig:
    """The "deberta-v3-base" preset with the sizes and options of a DebertaV2Config."""
    required = partial(required_field, hf, config_file)
    for key, ours in (("hidden_act", ACTIVATIONS), ("pooler_hidden_act", POOLER_ACTIVATIONS)):
        if hf.get(key, "gelu") not in ours:
            raise ForeignCheckpointError(f"{config_file}: {key}={hf[key]!r} is not supported "
                                         f"(choose one of {', '.join(ours)})")
    vocab_size = required("vocab_size")
    positions = hf.get("max_position_embeddings", 512)
    reach = hf.get("max_relative_positions", -1)
    try:
        config = preset(
            "deberta-v3-base", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
            d_model=required("hidden_size"), num_heads=required("num_attention_heads"),
            num_encoder_layers=required("num_hidden_layers"),
            d_ff=required("intermediate_size"),
            max_positions=positions, position_buckets=hf["position_buckets"],
            max_relative_positions=reach if isinstance(reach, int) and 0 < reach != positions
            else None,
            type_vocab_size=hf.get("type_vocab_size", 0),
            activation=ACTIVATIONS[hf.get("hidden_act", "gelu")],
            pooler_activation=POOLER_ACTIVATIONS[hf.get("pooler_hidden_act", "gelu")],
            layer_norm_eps=hf.get("layer_norm_eps", 1e-7),
            dropout=hf.get("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            num_labels=num_labels, token_classifier=task == TOKEN_CLASSIFIER,
            question_answering=task == QUESTION_ANSWERING)
        return with_tokenizer(config, hf, config_file, tokenizer)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None


def relative_positions(tensors, names: dict[str, str], config: ModelConfig, source: Path
                       ) -> dict:
    """The shared table of relative positions and its norm, as our state dict's."""
    def take(name: str, *shape: int):
        return take_weight(tensors, names, source, name, *shape)

    c = config.d_model
    return {"encoder.relative_positions.embedding.weight":
            take("encoder.rel_embeddings.weight", 2 * config.position_buckets, c),
            "encoder.relative_positions.norm.weight": take("encoder.LayerNorm.weight", c),
            "encoder.relative_positions.norm.bias": take("encoder.LayerNorm.bias", c)}


def _deberta_names(tensors, source: Path) -> dict[str, str]:
    """BERT's names of the stored tensors (hf_bert._bert_names), DeBERTa's own masked-LM
    head under BERT's."""
    names = _bert_names(tensors, source, encoder_names.DEBERTA.prefix)
    renamed: dict[str, str] = {}
    for name, key in names.items():
        for theirs, bert in MLM_NAMES.items():
            if name == theirs or name.startswith(f"{theirs}."):
                name = bert + name[len(theirs):]
        if name in renamed:
            raise ForeignCheckpointError(f"{source}: {key!r} and {renamed[name]!r} are the "
                                         f"same weight of the masked-LM head, stored twice")
        renamed[name] = key
    return renamed


def read_deberta_tokenizer(hf_dir: Path) -> HFTokenizer:
    """tokenizer.json (read as BERT's, [CLS] A [SEP] B [SEP]), else spm.model converted by
    transformers."""
    if (hf_dir / TOKENIZER_JSON).is_file() or not (hf_dir / SPM_MODEL).is_file():
        return read_tokenizer(hf_dir)
    try:
        from transformers import DebertaV2TokenizerFast
        from tokenizers import Tokenizer
    except ImportError:
        raise ForeignCheckpointError(
            f"{hf_dir}: no {TOKENIZER_JSON}, only {SPM_MODEL}, whose conversion needs "
            f"transformers (pip install 'transduce[export]'); or save the tokenizer's "
            f"{TOKENIZER_JSON} into the directory") from None
    try:
        converted = DebertaV2TokenizerFast.from_pretrained(str(hf_dir))
    except Exception as error:  # noqa: BLE001 - the converter raises many kinds
        raise ForeignCheckpointError(f"{hf_dir / SPM_MODEL}: not convertible by transformers "
                                     f"({type(error).__name__}: {error})") from None
    backend = Tokenizer.from_str(converted.backend_tokenizer.to_str())
    specials = {role: getattr(converted, f"{role}_token") for role in ("cls", "sep", "pad",
                                                                       "mask")}
    return HFTokenizer(backend, hf_dir / SPM_MODEL, bos=specials["cls"], eos=specials["sep"],
                       pad=specials["pad"], mask=specials["mask"])


DEBERTA = EncoderFamily(
    NAME, MODEL_TYPES, encoder_names.DEBERTA, poolers=("pooler.dense",),
    mlm_prefix="cls.predictions.", mlm_dense="cls.predictions.transform.dense",
    mlm_norm="cls.predictions.transform.LayerNorm",
    mlm_biases=("cls.predictions.bias", "cls.predictions.decoder.bias"),
    mlm_decoder="cls.predictions.decoder.weight", nsp=None, classifier="classifier",
    read_tokenizer=read_deberta_tokenizer, dropped=("mask_predictions",))
