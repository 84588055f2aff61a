"""Export an encoder-only model of ModernBERT's layout (prediction_head: an imported
ModernBERT, or one trained in its layout) to Hugging Face transformers as ModernBERT:
with a classification head as `ModernBertForSequenceClassification` (its class names as
id2label), a token classifier as `...ForTokenClassification`, a question answerer as
`...ForQuestionAnswering`, else as `ModernBertForMaskedLM`.

The weights are the inverse of the import's table (importers/hf_modernbert.py): q, k and
v's rows joined into Wqkv, the feed-forward network's input and gate into Wi, under the
task models' "model." prefix. Each layer's attention goes as layer_types, each kind's
rotary base as rope_parameters. The tokenizer goes as a tokenizer.json with BERT's
template, [CLS] A [SEP] B [SEP], and no segment ids (ModernBERT reads none).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from transduce.config import ModelConfig
from transduce.data.masking import MASK_ID
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.hf import save_with_tokenizer_json
from transduce.export.hf_encoder import module_weights, tied_output, bert_tokenizer, \
    write_sentence_transformers
from transduce.model import EncoderOnly

FAMILY = "ModernBERT"
# Our activations under ModernBERT's names (hidden_activation, classifier_activation).
ACTIVATIONS = {"gelu": "gelu", "gelu-tanh": "gelu_pytorch_tanh", "silu": "silu",
               "relu": "relu", "tanh": "tanh"}
# What ModernBERT's layers are: field -> the value it must have.
LAYOUT = {"norm_first": True, "positional": "rotary", "gated_ffn": True, "norm": "layer",
          "first_attention_norm": False, "type_vocab_size": 0, "scale_embeddings": False,
          "rope_scaling": "none", "qkv_bias": False, "sandwich_norm": False}


def is_modernbert_layout(config: ModelConfig) -> bool:
    """Whether an encoder-only model goes as ModernBERT: its heads read through a
    prediction head, which only ModernBERT's have."""
    return config.arch == "encoder" and config.prediction_head


def check_modernbert_exportable(model: EncoderOnly) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, arch="encoder", sliding=True, mixed=True,
                                       modernbert=True)
    problems += [f"{name}={getattr(c, name)!r} ({FAMILY}'s is {value!r})"
                 for name, value in LAYOUT.items() if getattr(c, name) != value]
    if c.kv_heads != c.num_heads or c.head_size not in (None, c.d_model // c.num_heads):
        problems.append(f"num_kv_heads={c.num_kv_heads}, head_size={c.head_size} ({FAMILY} "
                        f"has full multi-head attention of d_model / num_heads)")
    for name in ("activation", "pooler_activation"):
        if getattr(c, name) not in ACTIVATIONS:
            problems.append(f"{name}={getattr(c, name)!r} (not one of {sorted(ACTIVATIONS)})")
    if problems:
        raise ExportError(f"cannot export to {FAMILY} ({modernbert_class(model)}): "
                          + "; ".join(problems))


def modernbert_class(model: EncoderOnly) -> str:
    c = model.config
    task = "MaskedLM" if model.classifier is None else "QuestionAnswering" \
        if c.question_answering else "TokenClassification" if c.token_classifier \
        else "SequenceClassification"
    return f"ModernBertFor{task}"


def modernbert_config(model: EncoderOnly, tokenizer) -> dict:
    """The ModernBertConfig of the transformers model that holds this one."""
    c = model.config
    kinds = ["sliding_attention" if c.layer_attention_type(i) == "sliding"
             else "full_attention" for i in range(c.num_encoder_layers)]
    local_base = c.rope_base if c.local_rope_base is None else c.local_rope_base
    head_activation = c.pooler_activation if model.classifier is not None else c.activation
    config = {
        "architectures": [modernbert_class(model)], "model_type": "modernbert",
        "vocab_size": c.src_vocab_size, "hidden_size": c.d_model,
        "intermediate_size": c.d_ff, "num_hidden_layers": c.num_encoder_layers,
        "num_attention_heads": c.num_heads, "hidden_activation": ACTIVATIONS[c.activation],
        "max_position_embeddings": c.max_positions, "norm_eps": c.layer_norm_eps,
        "norm_bias": c.norm_bias, **dict.fromkeys(("attention_bias", "mlp_bias",
                                                   "classifier_bias"), c.bias),
        "decoder_bias": True, "local_attention": 2 * c.attention_window,
        "layer_types": kinds,
        "rope_parameters": {"full_attention": {"rope_type": "default",
                                               "rope_theta": c.rope_base},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": local_base}},
        "classifier_pooling": c.classifier_pooling,
        "classifier_activation": ACTIVATIONS[head_activation],
        "attention_dropout": c.attention_dropout,
        **dict.fromkeys(("embedding_dropout", "mlp_dropout", "classifier_dropout"), c.dropout),
        "pad_token_id": c.pad_id, "cls_token_id": tokenizer.bos_id,
        "bos_token_id": tokenizer.bos_id, "sep_token_id": tokenizer.eos_id,
        "eos_token_id": tokenizer.eos_id, "tie_word_embeddings": True}
    if model.classifier is not None:
        names = model.labels or [f"LABEL_{i}" for i in range(c.num_labels)]
        config["id2label"] = dict(enumerate(names))
        config["label2id"] = {name: i for i, name in enumerate(names)}
    return config


def modernbert_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the ModernBERT task model's names (hf_modernbert.py's table)."""
    embed = model.embed
    state = module_weights({"model.embeddings.tok_embeddings": embed.embedding,
                             "model.embeddings.norm": embed.norm,
                             "model.final_norm": model.encoder.final_norm})
    for i, layer in enumerate(model.encoder.layers):
        state |= _layer_weights(layer, f"model.layers.{i}", first=i == 0)
    if model.classifier is None:
        state |= module_weights({"head.dense": model.mlm_head.dense,
                                  "head.norm": model.mlm_head.norm})
        return state | tied_output(model, ("decoder.bias",), "decoder.weight")
    return state | module_weights({"head.dense": model.pooler, "head.norm": model.pooler_norm,
                                    "classifier": model.classifier})


def _layer_weights(layer, prefix: str, *, first: bool) -> dict[str, Tensor]:
    """One layer's: q, k, v joined as Wqkv's rows, linear1 and linear3 as Wi's."""
    attn, ffn = layer.self_attn, layer.ffn
    state = module_weights({f"{prefix}.attn.Wo": attn.out_proj,
                             f"{prefix}.mlp_norm": layer.norm2,
                             f"{prefix}.mlp.Wo": ffn.linear2,
                             **({} if first else {f"{prefix}.attn_norm": layer.norm1})})
    joined = {"attn.Wqkv": (attn.q_proj, attn.k_proj, attn.v_proj),
              "mlp.Wi": (ffn.linear1, ffn.linear3)}
    for name, parts in joined.items():
        for kind in ("weight", "bias"):
            if getattr(parts[0], kind) is not None:
                state[f"{prefix}.{name}.{kind}"] = torch.cat(
                    [getattr(part, kind).detach() for part in parts]).contiguous()
    return state


def modernbert_model(model: EncoderOnly, tokenizer):
    """A transformers ModernBERT holding our weights (in eval mode)."""
    import transformers

    check_modernbert_exportable(model)
    config = transformers.ModernBertConfig(**modernbert_config(model, tokenizer))
    theirs = getattr(transformers, modernbert_class(model))(config).eval()
    missing, unexpected = theirs.load_state_dict(modernbert_state_dict(model), strict=False)
    if missing or unexpected:
        raise ExportError(f"modernbert weights not set: {missing[:5]}; unknown: "
                          f"{unexpected[:5]}")
    return theirs


def export_hf_modernbert(directory: Path, model: EncoderOnly, out: Path) -> Path:
    """Write the checkpoint at `directory`, whose model is `model`, as OUT/ with
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json and our export
    marker; loadable with transformers' AutoModel... classes and AutoTokenizer -> OUT."""
    tokenizer = bert_tokenizer(directory)
    theirs = modernbert_model(model, tokenizer)       # checks what ModernBERT can hold first
    specials = {"cls_token": tokenizer.bos_id, "sep_token": tokenizer.eos_id,
                "pad_token": tokenizer.pad_id,
                "mask_token": MASK_ID if tokenizer.mask_id is None else tokenizer.mask_id}
    recorded = getattr(model, "sentence_embedding", None)
    return save_with_tokenizer_json(
        theirs, tokenizer, specials, model.config.max_positions, directory, out,
        None if recorded is None else
        lambda target: write_sentence_transformers(target, recorded, model.config.d_model),
        settings={"model_input_names": ["input_ids", "attention_mask"]})
