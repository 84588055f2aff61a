"""Hugging Face BERT (BertModel, BertForMaskedLM, BertForPreTraining,
BertForSequenceClassification or BertForTokenClassification directories) -> our
EncoderOnly.

BERT is the encoder-only model of the "bert-base" preset: post-norm layers, learned
positions, segment (token type) embeddings and an embedding LayerNorm, the pooler, and
the heads of pre-training and fine-tuning. The weights map one to one (nn.Linear both):

    embeddings.word_embeddings              encoder.embed.embedding
    embeddings.position_embeddings          encoder.embed.positions.embedding
    embeddings.token_type_embeddings        encoder.embed.segments
    embeddings.LayerNorm                    encoder.embed.norm
    encoder.layer.N.attention.self.query    encoder.layers.N.self_attn.q_proj (key, value)
    encoder.layer.N.attention.output.dense  encoder.layers.N.self_attn.out_proj
    encoder.layer.N.attention.output.LayerNorm   encoder.layers.N.norm1
    encoder.layer.N.intermediate.dense      encoder.layers.N.ffn.linear1
    encoder.layer.N.output.dense            encoder.layers.N.ffn.linear2
    encoder.layer.N.output.LayerNorm        encoder.layers.N.norm2
    pooler.dense                            pooler
    cls.predictions.transform.dense         mlm_head.dense
    cls.predictions.transform.LayerNorm     mlm_head.norm
    cls.predictions.bias (decoder.bias)     mlm_head.decoder.bias (the weight: tied)
    cls.seq_relationship                    nsp_head
    classifier                              classifier

The model's weights may carry a "bert." prefix (the task models) or not (BertModel),
and old checkpoints name LayerNorm parameters gamma and beta. Every key is accounted
for: the embeddings' position_ids / token_type_ids buffers are skipped, a stored
cls.predictions.decoder.weight must equal the word embeddings, and anything else, or a
missing weight, is an error naming the key. A head the checkpoint lacks (BertModel has
no cls.*, BertForMaskedLM no pooler and no NSP head) keeps its fresh initialisation,
and the checkpoint's origin lists it ("fresh_heads"). The tokenizer (tokenizer.json, or
vocab.txt with tokenizer_config.json's casing) travels with the checkpoint: bos [CLS],
eos [SEP], pad [PAD]. A sentence-transformers directory's pooling (modules.json) is
recorded, so that `embed` makes its vectors (sentence_transformers.py). A token
classifier's (config.json's architectures say so) classifier labels each token:
token_classifier, its id2label the tags; a question answerer's qa_outputs scores each
token's starting and ending the answer: question_answering.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.answer_windows import SPAN_LABELS
from transduce.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer
from transduce.data.tokenizer import TokenizerError
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_foreign_options, refuse_unread, take_weight
from transduce.importers import encoder_names
from transduce.importers.encoder_names import EncoderNames
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json, read_weights, tokenizer_settings
from transduce.importers.sentence_transformers import read_sentence_embedding
from transduce.model.encoder_only import EncoderOnly

VOCAB_TXT = "vocab.txt"

# Hugging Face hidden_act -> ModelConfig.activation (gelu_new and gelu_pytorch_tanh are
# the same tanh approximation, computed two ways).
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh",
               "relu": "relu"}
# Options whose other value changes what the model computes: name -> the value we have.
FIXED_OPTIONS = {"position_embedding_type": "absolute", "is_decoder": False,
                 "add_cross_attention": False}
_IGNORED = re.compile(r"^embeddings\.(position_ids|token_type_ids)$")   # index buffers
# The task models whose heads ours has no place for: their class names end with these.
OTHER_TASKS = {"ForMultipleChoice": "multiple-choice"}
# A token classifier's and a question answerer's classes (every family's), and what
# their heads are called there.
TOKEN_CLASSIFIER, QUESTION_ANSWERING = "ForTokenClassification", "ForQuestionAnswering"
TOKEN_HEADS = {TOKEN_CLASSIFIER: "classifier", QUESTION_ANSWERING: "qa_outputs"}
# The optional heads: our module -> what it is called in messages.
HEADS = {"pooler": "pooler", "mlm_head": "masked-LM head", "nsp_head": "next-sentence head",
         "classifier": "classification head"}


@dataclass(frozen=True)
class EncoderFamily:
    """Where a family of Hugging Face encoders (BERT, RoBERTa, DistilBERT) keeps what our
    EncoderOnly holds: the embeddings are named alike, the layers as `names` says, the
    heads as the fields below."""

    name: str                       # the import's name ("hf-bert"), for the origin
    model_types: tuple[str, ...]    # config.json's model_type
    names: EncoderNames             # the task models' prefix, the layers, the segments
    poolers: tuple[str, ...]        # the dense + tanh (or ReLU) over the first token
    mlm_prefix: str                 # the masked-LM head's, then its parts:
    mlm_dense: str
    mlm_norm: str
    mlm_biases: tuple[str, ...]     # the output bias, under any of these names
    mlm_decoder: str                # the output matrix, tied to the word embeddings
    nsp: str | None                 # the next-sentence head (None: the family has none)
    classifier: str                 # the classification head's output layer
    read_tokenizer: Callable[[Path], HFTokenizer]
    # The row of the position table that position 0 takes: RoBERTa counts from pad + 1.
    position_offset: Callable[[dict[str, Any]], int] = lambda hf: 0
    # The masked-LM head's activation where it is fixed (RoBERTa's: exact GELU, whatever
    # hidden_act says); None: hidden_act, as BERT's head and ours.
    mlm_activation: str | None = None
    # BertConfig's keys that the family's config.json calls otherwise (DistilBERT's "dim"
    # for "hidden_size"), or does not read (None: the default holds).
    keys: dict[str, str | None] = field(default_factory=dict)
    # Heads ours has no place for, whose weights are left unread (ELECTRA's discriminator
    # head, which fine-tuning replaces) and named in the origin ("dropped_heads").
    dropped: tuple[str, ...] = ()

    def key(self, bert_key: str) -> str | None:
        """The family's config.json key for BertConfig's `bert_key`."""
        return self.keys.get(bert_key, bert_key)


def import_bert(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face BERT directory (config.json, model.safetensors or
    pytorch_model.bin, tokenizer.json or vocab.txt) and write it as our checkpoint at
    `out`, replacing one there; nothing is written unless everything was read and
    checked. The heads the checkpoint lacks are initialised afresh and listed in the
    written config.json's origin["fresh_heads"] (see fresh_heads())."""
    return import_encoder(hf_dir, out, BERT)


def import_encoder(hf_dir: Path | str, out: Path | str, family: EncoderFamily) -> Path:
    """import_bert for any EncoderFamily."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    hf = _read_json(hf_dir / HF_CONFIG)
    check_options(hf, hf_dir / HF_CONFIG, family)
    tokenizer = family.read_tokenizer(hf_dir)
    sentence_embedding = read_sentence_embedding(hf_dir)     # a sentence-transformers model's
    tensors, source = read_weights(hf_dir)
    names, dropped = _without_dropped(_bert_names(tensors, source, family.names.prefix),
                                      family.dropped)
    task = token_task(hf)
    if task:                 # a linear layer over each token's state, named so everywhere
        family = replace(family, classifier=TOKEN_HEADS[task])
    labels = _labels(hf, hf_dir / HF_CONFIG) if f"{family.classifier}.weight" in names \
        else None
    if task == QUESTION_ANSWERING and labels is not None:
        labels = list(SPAN_LABELS)
    offset = family.position_offset(hf)
    config = model_config(hf, hf_dir / HF_CONFIG, tokenizer, family,
                          num_labels=len(labels) if labels else 0, position_offset=offset
                          ).replace(token_classifier=task == TOKEN_CLASSIFIER and bool(labels),
                                    question_answering=task == QUESTION_ANSWERING
                                    and bool(labels))
    state, found = map_weights(tensors, names, config, source, family, offset)
    del tensors          # the stored files are let go before the save copies the model
    return save_import(EncoderOnly(config), state, found, out, tokenizer,
                       origin={"imported": family.name, "from": str(hf_dir.resolve())},
                       labels=labels, sentence_embedding=sentence_embedding,
                       has_nsp=family.nsp is not None, dropped=dropped)


def save_import(model: EncoderOnly, state: dict[str, Tensor], found: set[str], out: Path,
                tokenizer: HFTokenizer, *, origin: dict[str, Any], labels: list[str] | None,
                sentence_embedding: dict | None, has_nsp: bool, dropped: list[str] = ()
                ) -> Path:
    """Our imported encoder saved at `out`: `state` holds every weight but those of the
    heads not `found` (HEADS), which keep the model's fresh initialisation and are
    listed in the origin ("fresh_heads"), as the heads left unread are ("dropped_heads")."""
    fresh = {name: tensor for name, tensor in model.state_dict().items()
             if _head_of(name) in HEADS and _head_of(name) not in found and name not in state}
    model.load_state_dict({**state, **fresh})
    model.labels, model.sentence_embedding = labels, sentence_embedding
    origin = {**origin, "steps": None,
              "fresh_heads": [head for head in HEADS if head not in found
                              and (head != "classifier" or model.config.num_labels)
                              and (head != "nsp_head" or has_nsp)],
              **({"dropped_heads": list(dropped)} if dropped else {})}
    return checkpoint.save(out, model.eval(), None, tokenizer, origin=origin)


def _head_of(name: str) -> str:
    """The head (a key of HEADS) a weight of ours belongs to, else its first module."""
    module = name.split(".")[0]
    return "pooler" if module == "pooler_norm" else module


def fresh_heads(path: Path | str) -> list[str]:
    """The heads of an imported BERT checkpoint that were not in what it was imported
    from, and hold a fresh initialisation ([] when all were there)."""
    return _origin_list(path, "fresh_heads")


def dropped_heads(path: Path | str) -> list[str]:
    """The heads of what an encoder was imported from that ours has no place for, left
    unread (ELECTRA's discriminator head)."""
    return _origin_list(path, "dropped_heads")


def _origin_list(path: Path | str, key: str) -> list[str]:
    file = Path(path) / checkpoint.CONFIG
    try:
        origin = json.loads(file.read_text(encoding="utf-8")).get("origin") or {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise checkpoint.CheckpointError(f"{file}: unreadable ({error})") from None
    return list(origin.get(key) or [])


def check_options(hf: dict[str, Any], config_file: Path, family: EncoderFamily) -> None:
    """A BERT (RoBERTa, DistilBERT) configuration whose options we can reproduce, of a
    task model whose heads ours holds."""
    check_foreign_options(hf, config_file, family.model_types, FIXED_OPTIONS,
                          family.key("hidden_act"), "gelu", ACTIVATIONS)
    check_task(hf, config_file)


def check_task(hf: dict[str, Any], config_file: Path) -> None:
    """A task model whose heads ours holds (architectures in config.json)."""
    classes = hf.get("architectures") or []
    for suffix, task in OTHER_TASKS.items():
        found = [name for name in classes if isinstance(name, str) and name.endswith(suffix)]
        if found:
            raise ForeignCheckpointError(
                f"{config_file}: architectures={found}: a {task} model, whose head ours has "
                f"no place for (ours holds the masked-LM, next-sentence, sequence- and "
                f"token-classification and question-answering heads)")


def token_task(hf: dict[str, Any]) -> str | None:
    """The head over each token that config.json's architectures name: a token
    classifier's (NER, tagging) or a question answerer's, or None."""
    return next((task for task in TOKEN_HEADS for name in hf.get("architectures") or []
                 if isinstance(name, str) and name.endswith(task)), None)


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer,
                 family: EncoderFamily, num_labels: int = 0, position_offset: int = 0
                 ) -> ModelConfig:
    """The "bert-base" preset with the sizes and options of a Hugging Face BertConfig
    (or RobertaConfig, whose first `position_offset` positions are never used, or
    DistilBertConfig, of other keys, no segments and fixed LayerNorm eps)."""

    def get(name: str, default: Any) -> Any:
        key = family.key(name)
        return default if key is None else hf.get(key, default)

    def required(name: str) -> Any:
        if family.key(name) not in hf:
            raise ForeignCheckpointError(f"{config_file}: no {family.key(name)!r}")
        return hf[family.key(name)]

    vocab_size = required("vocab_size")
    segments = get("type_vocab_size", 2) if family.names.segments else 0
    width = get("embedding_size", None)       # ELECTRA's: its embeddings' (BERT's: none)
    try:
        config = preset("bert-base", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                        d_model=required("hidden_size"),
                        num_heads=required("num_attention_heads"),
                        num_encoder_layers=required("num_hidden_layers"),
                        d_ff=required("intermediate_size"),
                        max_positions=get("max_position_embeddings", 512) - position_offset,
                        type_vocab_size=segments,
                        embedding_size=None if width == hf.get(family.key("hidden_size"))
                        else width,
                        pooler_activation=family.names.pooler_activation,
                        activation=ACTIVATIONS[get("hidden_act", "gelu")],
                        layer_norm_eps=get("layer_norm_eps", 1e-12),
                        dropout=get("hidden_dropout_prob", 0.1),
                        attention_dropout=get("attention_probs_dropout_prob", 0.1),
                        num_labels=num_labels)
        config = with_tokenizer(config, hf, config_file, tokenizer)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    return config


def with_tokenizer(config: ModelConfig, hf: dict[str, Any], config_file: Path,
                   tokenizer: HFTokenizer) -> ModelConfig:
    """`config` with the tokenizer's pad id, once the vocabulary holds the tokenizer's
    tokens and config.json's pad_token_id (if any) is the tokenizer's pad token."""
    if tokenizer.vocab_size > config.src_vocab_size:
        raise ForeignCheckpointError(f"{config_file}: vocab_size={config.src_vocab_size} is "
                                     f"smaller than the tokenizer's {tokenizer.vocab_size} "
                                     f"tokens")
    if hf.get("pad_token_id") is not None and hf["pad_token_id"] != tokenizer.pad_id:
        raise ForeignCheckpointError(
            f"{config_file}: pad_token_id={hf['pad_token_id']} but the tokenizer's pad token "
            f"{tokenizer.piece(tokenizer.pad_id)!r} is {tokenizer.pad_id}")
    return config.replace(pad_id=tokenizer.pad_id)


def read_tokenizer(hf_dir: Path) -> HFTokenizer:
    """The directory's tokenizer.json, else its vocab.txt (lowercased, accents stripped
    and Chinese characters split as tokenizer_config.json's do_lower_case, strip_accents
    and tokenize_chinese_chars say; BERT's defaults: True, as lowercasing, True), with
    the special tokens its tokenizer_config.json / special_tokens_map.json name
    (BERT's defaults: [CLS] bos, [SEP] eos, [PAD], [MASK], [UNK])."""
    specials, options = tokenizer_settings(
        hf_dir, {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]",
                 "unk": "[UNK]"}, ("do_lower_case", "strip_accents", "tokenize_chinese_chars"))
    try:
        if (hf_dir / TOKENIZER_JSON).is_file():
            tokenizer = HFTokenizer.from_file(hf_dir / TOKENIZER_JSON, bos=specials["cls"],
                                              eos=specials["sep"], pad=specials["pad"])
            tokenizer = tokenizer.with_mask(specials["mask"])
            if not tokenizer.prepend_bos:   # no [CLS] A [SEP] template: give it BERT's,
                tokenizer = tokenizer.with_bert_template()   # which the checkpoint keeps
        elif (hf_dir / VOCAB_TXT).is_file():
            tokenizer = HFTokenizer.from_wordpiece(
                hf_dir / VOCAB_TXT, lowercase=bool(options.get("do_lower_case", True)),
                strip_accents=options.get("strip_accents"),
                chinese_chars=bool(options.get("tokenize_chinese_chars", True)),
                unk=specials["unk"], bos=specials["cls"], eos=specials["sep"],
                pad=specials["pad"], mask=specials["mask"])
        else:
            raise ForeignCheckpointError(f"{hf_dir}: no tokenizer ({TOKENIZER_JSON} or "
                                         f"{VOCAB_TXT})")
    except TokenizerError as error:
        raise ForeignCheckpointError(str(error)) from None
    return tokenizer


def _bert_names(tensors: dict[str, Tensor], source: Path, prefix: str = "bert."
                ) -> dict[str, str]:
    """BERT's name of each stored tensor (no "bert." prefix, LayerNorm gamma / beta as
    weight / bias) -> the stored key."""
    names: dict[str, str] = {}
    for key in tensors:
        name = key.removeprefix(prefix)
        name = re.sub(r"(LayerNorm)\.gamma$", r"\1.weight", name)
        name = re.sub(r"(LayerNorm)\.beta$", r"\1.bias", name)
        if name in names:
            raise ForeignCheckpointError(f"{source}: {key!r} and {names[name]!r} are the same "
                                         f"weight {name!r}, stored twice")
        names[name] = key
    return names


def _without_dropped(names: dict[str, str], heads: tuple[str, ...]
                     ) -> tuple[dict[str, str], list[str]]:
    """The names without those of the heads left unread, and those heads found."""
    dropped = sorted({head for head in heads for name in names if name.startswith(f"{head}.")})
    prefixes = tuple(f"{head}." for head in dropped)
    return {name: key for name, key in names.items() if not name.startswith(prefixes)}, dropped


def _labels(hf: dict[str, Any], config_file: Path) -> list[str]:
    """The classes' names in id order, from id2label (else num_labels, else 2 as
    transformers' default, named LABEL_i)."""
    id2label = hf.get("id2label")
    if id2label is None:
        count = hf.get("num_labels", 2)
        return [f"LABEL_{i}" for i in range(count)]
    if not isinstance(id2label, dict):
        raise ForeignCheckpointError(f"{config_file}: id2label must be an object")
    try:
        by_id = {int(key): str(value) for key, value in id2label.items()}
    except ValueError:
        raise ForeignCheckpointError(f"{config_file}: id2label keys must be class ids, got "
                                     f"{sorted(id2label)}") from None
    if sorted(by_id) != list(range(len(by_id))) or not by_id:
        raise ForeignCheckpointError(f"{config_file}: id2label must number the classes 0 to "
                                     f"n-1, got {sorted(by_id)}")
    return [by_id[i] for i in range(len(by_id))]


def map_weights(tensors: dict[str, Tensor], names: dict[str, str], config: ModelConfig,
                source: Path, family: EncoderFamily, position_offset: int = 0
                ) -> tuple[dict[str, Tensor], set[str]]:
    """BERT's tensors -> (our state dict in float32, without the heads the checkpoint
    lacks; the heads it has). Each key accounted for, each shape checked. The position
    table, where the model has one, loses its first position_offset rows (RoBERTa's:
    padding's and unused).
    Embeddings narrower than the layers (ELECTRA-small's) come with their projection."""
    f = family
    names = dict(names)
    c, ff, v, e = config.d_model, config.d_ff, config.src_vocab_size, config.embedding_width
    sizes = {"ffn.linear1": (c, ff), "ffn.linear2": (ff, c)}     # the others': (c, c)

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    def linear(ours: str, theirs: str, n_in: int, n_out: int) -> None:
        state[f"{ours}.weight"] = take(f"{theirs}.weight", n_out, n_in)
        state[f"{ours}.bias"] = take(f"{theirs}.bias", n_out)

    def norm(ours: str, theirs: str, width: int = c) -> None:
        state[f"{ours}.weight"] = take(f"{theirs}.weight", width)
        state[f"{ours}.bias"] = take(f"{theirs}.bias", width)

    embedding = take("embeddings.word_embeddings.weight", v, e)
    state = {"encoder.embed.embedding.weight": embedding,
             "mlm_head.decoder.weight": embedding}             # tied, whatever is found
    if config.positional == "learned":                         # DeBERTa's: none
        state["encoder.embed.positions.embedding.weight"] = take(
            "embeddings.position_embeddings.weight", config.max_positions + position_offset,
            e)[position_offset:]
    if f.names.segments and config.type_vocab_size:           # DeBERTa-v3's: none
        state["encoder.embed.segments.weight"] = take(f"{f.names.segments}.weight",
                                                      config.type_vocab_size, e)
    norm("encoder.embed.norm", "embeddings.LayerNorm", e)
    if config.embedding_size is not None:
        linear("encoder.embed.project", "embeddings_project", e, c)
    for i in range(config.num_encoder_layers):
        for ours in f.names.layer:
            theirs = f.names.layer_module(i, ours)
            if ours.startswith("norm"):
                norm(f"encoder.layers.{i}.{ours}", theirs)
            else:
                linear(f"encoder.layers.{i}.{ours}", theirs, *sizes.get(ours, (c, c)))

    found: set[str] = set()

    def head(ours: str, prefix: str, read: Callable[[], None]) -> None:
        """A head is read whole when any of its weights is there, else left out."""
        if any(name.startswith(prefix) for name in names):
            read()
            found.add(ours)

    poolers = [name for name in f.poolers if f"{name}.weight" in names]
    if len(poolers) > 1:
        raise ForeignCheckpointError(f"{source}: two poolers, {poolers[0]!r} and "
                                     f"{poolers[1]!r}; a model has one")
    for name in poolers:
        head("pooler", f"{name}.", lambda: linear("pooler", name, c, c))
    head("mlm_head", f.mlm_prefix, lambda: _mlm_head(state, names, tensors, take, linear, norm,
                                                     embedding, source, f, config))
    if f.nsp is not None:
        head("nsp_head", f"{f.nsp}.", lambda: linear("nsp_head", f.nsp, c, 2))
    if config.num_labels:
        head("classifier", f"{f.classifier}.",
             lambda: linear("classifier", f.classifier, c, config.num_labels))
    refuse_unread(names, source, _IGNORED)
    return state, found


def _mlm_head(state, names, tensors, take, linear, norm, embedding, source,
              family: EncoderFamily, config: ModelConfig) -> None:
    """The masked-LM head: the transform (to the embeddings' width), the output bias
    (stored under either of its names, or both and equal), and the output matrix, which
    must be the word embeddings."""
    c, e, f, activation = config.d_model, config.embedding_width, family, config.activation
    if f.mlm_activation is not None and activation != f.mlm_activation:
        raise ForeignCheckpointError(
            f"{source}: a masked-LM head ({f.mlm_prefix}*), whose activation is "
            f"{f.mlm_activation!r} whatever hidden_act says, in a model of activation "
            f"{activation!r}; ours would compute the head with {activation!r}, so only "
            f"models of hidden_act {f.mlm_activation!r} can be imported with it")
    linear("mlm_head.dense", f.mlm_dense, c, e)
    norm("mlm_head.norm", f.mlm_norm, e)
    biases = [name for name in f.mlm_biases if name in names]
    if not biases:
        raise ForeignCheckpointError(f"{source}: missing weight "
                                     f"{' (or '.join(map(repr, f.mlm_biases))}"
                                     f"{')' * (len(f.mlm_biases) - 1)}")
    values = [take(name, embedding.shape[0]) for name in biases]
    if len(values) == 2 and not torch.equal(*values):
        raise ForeignCheckpointError(f"{source}: {biases[0]!r} differs from {biases[1]!r}")
    state["mlm_head.decoder.bias"] = values[0]
    if f.mlm_decoder in names:
        decoder = tensors[names.pop(f.mlm_decoder)]
        if decoder.shape != embedding.shape or not torch.equal(decoder.float(), embedding):
            raise ForeignCheckpointError(
                f"{source}: {f.mlm_decoder!r} differs from "
                f"'embeddings.word_embeddings.weight'; only tied output embeddings can be "
                f"imported")


BERT = EncoderFamily(
    "hf-bert", ("bert",), encoder_names.BERT, poolers=("pooler.dense",),
    mlm_prefix="cls.predictions.",
    mlm_dense="cls.predictions.transform.dense", mlm_norm="cls.predictions.transform.LayerNorm",
    mlm_biases=("cls.predictions.bias", "cls.predictions.decoder.bias"),
    mlm_decoder="cls.predictions.decoder.weight", nsp="cls.seq_relationship",
    classifier="classifier", read_tokenizer=read_tokenizer)



