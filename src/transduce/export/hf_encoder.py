"""Export an encoder-only model to Hugging Face transformers as BERT: with a
classification head as `BertForSequenceClassification` (its class names as id2label),
else as `BertForPreTraining` (the masked-LM and next-sentence heads with the pooler).
A model of one segment type (type_vocab_size 1: an imported RoBERTa or XLM-R) goes as
RoBERTa, `RobertaForSequenceClassification` or `RobertaForMaskedLM` (which has no
pooler), as transformers could not read a second segment of the BERT template; one of
none (an imported DistilBERT) as `DistilBertForSequenceClassification` or
`DistilBertForMaskedLM` (no pooler either), whose tokenizer gives no segment ids; one
whose pooler is followed by GELU (an imported ELECTRA) as
`ElectraForSequenceClassification` or `ElectraForMaskedLM` (a generator's head); one of
disentangled positions (an imported DeBERTa-v3) as `DebertaV2ForSequenceClassification`
or `DebertaV2ForMaskedLM`, with its table of relative positions. A
token classifier goes as the family's `...ForTokenClassification` (its tags as
id2label), a question answerer as its `...ForQuestionAnswering`.

Our BERT holds BERT's layers as they are, so the weights only change names: the
inverse of the imports' table (importers/encoder_names.py), under the task models'
"bert." ("roberta.", "distilbert.") prefix. RoBERTa counts positions from pad + 1, so
its table gets pad + 1 rows in front, which no real token reads. The tokenizer goes
with them as a tokenizer.json that gives our ids with BERT's template, [CLS] A [SEP]
(RoBERTa's, <s> A </s>): an imported model's own, or our SentencePiece model written out
(HFTokenizer.from_sentencepiece), whose [CLS], [SEP] and [MASK] are bos, eos and the
unknown piece (data/masking.py). A model that records its sentence embeddings' pooling
(an imported sentence-transformers model) takes its modules.json along.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from transduce import checkpoint
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.masking import MASK_ID
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.hf import save_with_tokenizer_json
from transduce.importers import encoder_names as families
from transduce.importers.encoder_names import EncoderNames, encoder_names
from transduce.model import EncoderOnly

# Our activations under BERT's names (hidden_act).
BERT_ACTIVATIONS = {"gelu": "gelu", "gelu-tanh": "gelu_new", "relu": "relu"}
DISTILBERT_EPS = 1e-12
# What BERT's layers are: field -> the value it must have.
BERT_LAYOUT = {"positional": "learned", "norm": "layer", "norm_first": False,
               "gated_ffn": False, "bias": True, "scale_embeddings": False}


def check_bert_exportable(model: EncoderOnly) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, arch="encoder", projected_embeddings=encoder_names(
        c) is families.ELECTRA)
    family = encoder_names(c).family
    problems += [f"{name}={getattr(c, name)!r} ({family}'s is {value!r})"
                 for name, value in family_layout(c).items() if getattr(c, name) != value]
    if c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} (BERT has full multi-head attention)")
    if c.activation not in BERT_ACTIVATIONS:
        problems.append(f"activation={c.activation!r} (not one of {sorted(BERT_ACTIVATIONS)})")
    elif encoder_names(c) in (families.ROBERTA, families.ELECTRA) and \
            model.classifier is None and c.activation != "gelu":
        problems.append(f"activation={c.activation!r}, which goes as {bert_class(model)}, "
                        f"whose head computes exact GELU whatever hidden_act says")
    problems += _not_the_familys(model)
    if problems:
        raise ExportError(f"cannot export to {encoder_names(c).family} ({bert_class(model)}): "
                          + "; ".join(problems))


def family_layout(config) -> dict:
    """What the family's layers are (BERT_LAYOUT; DeBERTa's positions disentangled)."""
    if encoder_names(config) is families.DEBERTA:
        return BERT_LAYOUT | {"positional": "disentangled"}
    return BERT_LAYOUT


def _not_the_familys(model: EncoderOnly) -> list[str]:
    """What the family the model goes as computes otherwise: its pooler's activation
    (where the class has a pooler, and fixes it: DeBERTa's config names its own),
    DistilBERT's fixed LayerNorm eps."""
    c, names = model.config, encoder_names(model.config)
    problems = []
    has_pooler = not reads_tokens(c) and names is not families.DEBERTA and (
        names is families.BERT or model.classifier is not None)
    if has_pooler and c.pooler_activation != names.pooler_activation:
        problems.append(f"pooler_activation={c.pooler_activation!r} ({bert_class(model)}'s "
                        f"pooler has {names.pooler_activation})")
    if names is families.DISTILBERT and c.layer_norm_eps != DISTILBERT_EPS:
        problems.append(f"layer_norm_eps={c.layer_norm_eps:g} (DistilBERT's LayerNorms take "
                        f"{DISTILBERT_EPS:g})")
    return problems


def bert_config(model: EncoderOnly) -> dict:
    """The BertConfig of the transformers model that holds this one."""
    c = model.config
    config = {"architectures": [bert_class(model)], "model_type": "bert",
              "vocab_size": c.src_vocab_size, "hidden_size": c.d_model,
              "num_hidden_layers": c.num_encoder_layers, "num_attention_heads": c.num_heads,
              "intermediate_size": c.d_ff, "hidden_act": BERT_ACTIVATIONS[c.activation],
              "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.attention_dropout,
              "max_position_embeddings": c.max_positions, "type_vocab_size": c.type_vocab_size,
              "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_id}
    if model.classifier is not None:
        names = model.labels or [f"LABEL_{i}" for i in range(c.num_labels)]
        config["id2label"] = dict(enumerate(names))
        config["label2id"] = {name: i for i, name in enumerate(names)}
    return config


def bert_class(model: EncoderOnly) -> str:
    names = encoder_names(model.config)
    family = {families.ROBERTA: "Roberta", families.DISTILBERT: "DistilBert",
              families.ELECTRA: "Electra", families.DEBERTA: "DebertaV2"}.get(names)
    if model.classifier is not None and reads_tokens(model.config):
        task = "QuestionAnswering" if model.config.question_answering else \
            "TokenClassification"
        return f"{family or 'Bert'}For{task}"
    if family is None:
        return "BertForSequenceClassification" if model.classifier is not None \
            else "BertForPreTraining"
    return f"{family}ForSequenceClassification" if model.classifier is not None \
        else f"{family}ForMaskedLM"


def is_roberta(model: EncoderOnly) -> bool:
    """Whether the model goes as RoBERTa (one segment type: encoder_names)."""
    return encoder_names(model.config) is families.ROBERTA


def roberta_config(model: EncoderOnly) -> dict:
    """The RobertaConfig of the transformers model that holds this one: BERT's, with
    pad + 1 more positions."""
    c = model.config
    return {**bert_config(model), "model_type": "roberta",
            "architectures": [bert_class(model)],
            "max_position_embeddings": c.max_positions + c.pad_id + 1}


def electra_config(model: EncoderOnly) -> dict:
    """The ElectraConfig of the transformers model that holds this one: BERT's, with
    the embeddings' width."""
    return {**bert_config(model), "model_type": "electra",
            "architectures": [bert_class(model)],
            "embedding_size": model.config.embedding_width}


def deberta_config(model: EncoderOnly) -> dict:
    """The DebertaV2Config of the transformers model that holds this one: BERT's, with
    DeBERTa-v3's disentangled attention (importers/hf_deberta.py's LAYOUT)."""
    from transduce.importers.hf_deberta import LAYOUT

    c = model.config
    config = {**bert_config(model), "model_type": "deberta-v2",
              "architectures": [bert_class(model)], "position_buckets": c.position_buckets,
              "max_relative_positions": c.relative_reach, "pos_att_type": ["p2c", "c2p"],
              "pooler_hidden_act": c.pooler_activation, "pooler_hidden_size": c.d_model,
              "pooler_dropout": 0.0, "legacy": True}
    return config | {key: ours for key, (_, ours) in LAYOUT.items()}


def distilbert_config(model: EncoderOnly) -> dict:
    """The DistilBertConfig of the transformers model that holds this one: BERT's
    values under DistilBERT's keys (importers/hf_distilbert.py's)."""
    from transduce.importers.hf_distilbert import CONFIG_KEYS

    bert = bert_config(model)
    config = {"architectures": [bert_class(model)], "model_type": "distilbert",
              "sinusoidal_pos_embds": False, "tie_weights_": True,
              "seq_classif_dropout": model.config.dropout,
              **{CONFIG_KEYS.get(key, key): value for key, value in bert.items()
                 if key not in ("architectures", "model_type", "type_vocab_size")}}
    config.pop(None, None)                            # layer_norm_eps: fixed
    return config


def roberta_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the RoBERTa task model's names (importers/hf_roberta.py's)."""
    from transduce.importers.hf_roberta import ROBERTA

    state = _layer_weights(model, families.ROBERTA)
    table = state["roberta.embeddings.position_embeddings.weight"]
    state["roberta.embeddings.position_embeddings.weight"] = torch.cat(
        [table.new_zeros(model.config.pad_id + 1, table.shape[1]), table])
    return state | _family_heads(model, ROBERTA)


def bert_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the BERT task model's names (importers/hf_bert.py's table)."""
    state = _layer_weights(model, families.BERT)
    if reads_tokens(model.config):                  # BertForTokenClassification has
        return state | _token_head(model)           # no pooler (nor ...QuestionAnswering)
    state |= module_weights({"bert.pooler.dense": model.pooler})
    if model.classifier is not None:
        return state | module_weights({"classifier": model.classifier})
    head = model.mlm_head
    state |= module_weights({"cls.predictions.transform.dense": head.dense,
                              "cls.predictions.transform.LayerNorm": head.norm,
                              "cls.seq_relationship": model.nsp_head})
    return state | tied_output(model, ("cls.predictions.bias", "cls.predictions.decoder.bias"),
                                "cls.predictions.decoder.weight")


def distilbert_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the DistilBERT task model's names (hf_distilbert.py's)."""
    from transduce.importers.hf_distilbert import DISTILBERT

    return _layer_weights(model, families.DISTILBERT) | _family_heads(model, DISTILBERT)


def electra_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the ELECTRA task model's names (importers/hf_electra.py's)."""
    from transduce.importers.hf_electra import ELECTRA

    return _layer_weights(model, families.ELECTRA) | _family_heads(model, ELECTRA)


def deberta_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the DeBERTa task model's names (importers/hf_deberta.py's), with
    the layers' shared table of relative positions."""
    from transduce.importers.hf_deberta import DEBERTA

    relative = model.encoder.relative_positions
    return _layer_weights(model, families.DEBERTA) | _family_heads(model, DEBERTA) | \
        module_weights({"deberta.encoder.rel_embeddings": relative.embedding,
                        "deberta.encoder.LayerNorm": relative.norm})


def _family_heads(model: EncoderOnly, family) -> dict[str, Tensor]:
    """The head of a family without BERT's pooler and next-sentence head (RoBERTa,
    DistilBERT, ELECTRA) under the names its import reads (an importers.hf_bert
    EncoderFamily): a head over each token, else the sequence classifier
    (encoder_names' classifier_head), else the masked-LM head with its tied output."""
    if reads_tokens(model.config):
        return _token_head(model)
    if model.classifier is not None:
        return module_weights({theirs: getattr(model, ours)
                               for theirs, ours in family.names.classifier_head.items()})
    return module_weights({family.mlm_dense: model.mlm_head.dense,
                           family.mlm_norm: model.mlm_head.norm}) | \
        tied_output(model, family.mlm_biases, family.mlm_decoder)


def reads_tokens(config) -> bool:
    """Whether the model's head reads each token: a token classifier's or a question
    answerer's."""
    return config.token_classifier or config.question_answering


def _token_head(model: EncoderOnly) -> dict[str, Tensor]:
    """A head over each token: "classifier" in every family's *ForTokenClassification,
    "qa_outputs" in its *ForQuestionAnswering."""
    name = "qa_outputs" if model.config.question_answering else "classifier"
    return module_weights({name: model.classifier})


def hf_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the names of the transformers class bert_class() names."""
    return {families.BERT: bert_state_dict, families.ROBERTA: roberta_state_dict,
            families.DISTILBERT: distilbert_state_dict,
            families.ELECTRA: electra_state_dict,
            families.DEBERTA: deberta_state_dict}[encoder_names(model.config)](model)


def tied_output(model: EncoderOnly, bias_names: tuple[str, ...], weight_name: str
                 ) -> dict[str, Tensor]:
    """The masked-LM head's output layer: its bias under each of `bias_names` (where
    transformers looks for it), its matrix (the word embeddings, tied) as `weight_name`."""
    bias = model.mlm_head.decoder.bias.detach()
    return {**{name: bias.clone() for name in bias_names},
            weight_name: model.embed.embedding.weight.detach().clone()}


def _layer_weights(model: EncoderOnly, names: EncoderNames) -> dict[str, Tensor]:
    """The embeddings' and the layers' weights under the family's names."""
    embed, prefix = model.embed, names.prefix
    modules = {f"{prefix}embeddings.word_embeddings": embed.embedding,
               f"{prefix}embeddings.LayerNorm": embed.norm}
    if embed.positions is not None:                # DeBERTa's: none
        modules[f"{prefix}embeddings.position_embeddings"] = embed.positions.embedding
    if names.segments and embed.segments is not None:
        modules[f"{prefix}{names.segments}"] = embed.segments
    if embed.project is not None:                  # ELECTRA's narrower embeddings
        modules[f"{prefix}embeddings_project"] = embed.project
    for i, layer in enumerate(model.encoder.layers):
        modules |= {f"{prefix}{names.layer_module(i, ours)}": layer.get_submodule(ours)
                    for ours in names.layer}
    return module_weights(modules)


def module_weights(modules: dict[str, nn.Module]) -> dict[str, Tensor]:
    """{name.weight, name.bias: a copy} of each module."""
    return {f"{name}.{kind}": getattr(module, kind).detach().clone().contiguous()
            for name, module in modules.items()
            for kind in ("weight", "bias") if getattr(module, kind, None) is not None}


def bert_model(model: EncoderOnly):
    """A transformers BERT holding our weights (in eval mode)."""
    import transformers

    check_bert_exportable(model)
    names = encoder_names(model.config)
    config_class, settings = {
        families.BERT: (transformers.BertConfig, bert_config),
        families.ROBERTA: (transformers.RobertaConfig, roberta_config),
        families.DISTILBERT: (transformers.DistilBertConfig, distilbert_config),
        families.ELECTRA: (transformers.ElectraConfig, electra_config),
        families.DEBERTA: (transformers.DebertaV2Config, deberta_config)}[names]
    config = config_class(**settings(model))
    theirs = getattr(transformers, bert_class(model))(config).eval()
    missing, unexpected = theirs.load_state_dict(hf_state_dict(model), strict=False)
    left = [name for name in missing if not name.endswith("position_ids")]
    if left or unexpected:
        raise ExportError(f"{config.model_type} weights not set: {left[:5]}; unknown: "
                          f"{unexpected[:5]}")
    return theirs


def bert_tokenizer(directory: Path, roberta: bool = False) -> HFTokenizer:
    """The checkpoint's tokenizer as a tokenizer.json backend with BERT's template (or
    RoBERTa's)."""
    tokenizer = checkpoint.load_tokenizer(directory)
    if not isinstance(tokenizer, HFTokenizer):
        tokenizer = HFTokenizer.from_sentencepiece(tokenizer)
    return tokenizer.with_roberta_template() if roberta else tokenizer.with_bert_template()


def export_hf_encoder(directory: Path, model: EncoderOnly, out: Path) -> Path:
    """Write the checkpoint at `directory`, whose model is `model`, as OUT/ with
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json and our export
    marker; loadable with transformers' AutoModel... classes and AutoTokenizer -> OUT."""
    theirs = bert_model(model)             # checks what BERT can hold first
    tokenizer = bert_tokenizer(directory, is_roberta(model))
    specials = {"cls_token": tokenizer.bos_id, "sep_token": tokenizer.eos_id,
                "pad_token": tokenizer.pad_id,
                "mask_token": MASK_ID if tokenizer.mask_id is None else tokenizer.mask_id}
    if is_roberta(model):   # RoBERTa's tokenizer names <s> and </s> twice
        specials |= {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
    recorded = getattr(model, "sentence_embedding", None)
    inputs = {"model_input_names": list(encoder_names(model.config).model_inputs)}
    return save_with_tokenizer_json(
        theirs, tokenizer, specials, model.config.max_positions, directory, out,
        None if recorded is None else
        lambda target: write_sentence_transformers(target, recorded, model.config.d_model),
        settings=inputs)


def write_sentence_transformers(directory: Path, recorded: dict, width: int) -> None:
    """A sentence-transformers model's modules.json, 1_Pooling/config.json (and
    2_Normalize), so that it pools as the checkpoint records (an imported one's way)."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if recorded["normalize"]:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir()
    (directory / "modules.json").write_text(json.dumps(modules, indent=2), encoding="utf-8")
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": width,
        "pooling_mode_cls_token": recorded["pooling"] == "cls",
        "pooling_mode_mean_tokens": recorded["pooling"] == "mean",
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False},
        indent=2), encoding="utf-8")
