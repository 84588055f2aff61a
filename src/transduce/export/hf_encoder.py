"""Export an encoder-only model to Hugging Face transformers as BERT: with a
classification head as `BertForSequenceClassification` (its class names as id2label),
else as `BertForPreTraining` (the masked-LM and next-sentence heads with the pooler).

Our BERT holds BERT's layers as they are, so the weights only change names: the
inverse of importers/hf_bert.py's table, under the task models' "bert." prefix. The
tokenizer goes with them as a tokenizer.json that gives our ids with BERT's template,
[CLS] A [SEP]: an imported model's own, or our SentencePiece model written out
(HFTokenizer.from_sentencepiece), whose [CLS], [SEP] and [MASK] are bos, eos and the
unknown piece (data/masking.py).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from transduce import checkpoint
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.masking import MASK_ID
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.hf import save_with_tokenizer_json
from transduce.model import EncoderOnly

# Our activations under BERT's names (hidden_act).
BERT_ACTIVATIONS = {"gelu": "gelu", "gelu-tanh": "gelu_new", "relu": "relu"}
# What BERT's layers are: field -> the value it must have.
BERT_LAYOUT = {"positional": "learned", "norm": "layer", "norm_first": False,
               "gated_ffn": False, "bias": True, "scale_embeddings": False}


def check_bert_exportable(model: EncoderOnly) -> None:
    c = model.config
    problems = not_a_plain_transformer(c, arch="encoder")
    problems += [f"{name}={getattr(c, name)!r} (BERT's is {value!r})"
                 for name, value in BERT_LAYOUT.items() if getattr(c, name) != value]
    if c.kv_heads != c.num_heads:
        problems.append(f"num_kv_heads={c.num_kv_heads} (BERT has full multi-head attention)")
    if c.activation not in BERT_ACTIVATIONS:
        problems.append(f"activation={c.activation!r} (not one of {sorted(BERT_ACTIVATIONS)})")
    if problems:
        raise ExportError("cannot export to BERT: " + "; ".join(problems))


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
    return "BertForSequenceClassification" if model.classifier is not None \
        else "BertForPreTraining"


def bert_state_dict(model: EncoderOnly) -> dict[str, Tensor]:
    """Our weights under the BERT task model's names (importers/hf_bert.py's table)."""
    embed = model.embed
    modules = {"bert.embeddings.word_embeddings": embed.embedding,
               "bert.embeddings.position_embeddings": embed.positions.embedding,
               "bert.embeddings.token_type_embeddings": embed.segments,
               "bert.embeddings.LayerNorm": embed.norm, "bert.pooler.dense": model.pooler}
    for i, layer in enumerate(model.encoder.layers):
        prefix, attn = f"bert.encoder.layer.{i}", layer.self_attn
        modules |= {f"{prefix}.attention.self.query": attn.q_proj,
                    f"{prefix}.attention.self.key": attn.k_proj,
                    f"{prefix}.attention.self.value": attn.v_proj,
                    f"{prefix}.attention.output.dense": attn.out_proj,
                    f"{prefix}.attention.output.LayerNorm": layer.norm1,
                    f"{prefix}.intermediate.dense": layer.ffn.linear1,
                    f"{prefix}.output.dense": layer.ffn.linear2,
                    f"{prefix}.output.LayerNorm": layer.norm2}
    if model.classifier is not None:
        modules["classifier"] = model.classifier
    else:
        head = model.mlm_head
        modules |= {"cls.predictions.transform.dense": head.dense,
                    "cls.predictions.transform.LayerNorm": head.norm,
                    "cls.seq_relationship": model.nsp_head}
    state = {f"{name}.{kind}": getattr(module, kind) for name, module in modules.items()
             for kind in ("weight", "bias") if getattr(module, kind, None) is not None}
    if model.classifier is None:   # the decoder's weight is the word embeddings (tied),
        for name in ("cls.predictions.bias", "cls.predictions.decoder.bias"):   # its bias
            state[name] = model.mlm_head.decoder.bias             # under both of BERT's names
        state["cls.predictions.decoder.weight"] = embed.embedding.weight
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def bert_model(model: EncoderOnly):
    """A transformers BERT holding our weights (in eval mode)."""
    import transformers

    check_bert_exportable(model)
    config = transformers.BertConfig(**bert_config(model))
    theirs = getattr(transformers, bert_class(model))(config).eval()
    missing, unexpected = theirs.load_state_dict(bert_state_dict(model), strict=False)
    left = [name for name in missing if not name.endswith("position_ids")]
    if left or unexpected:
        raise ExportError(f"BERT weights not set: {left[:5]}; unknown: {unexpected[:5]}")
    return theirs


def bert_tokenizer(directory: Path) -> HFTokenizer:
    """The checkpoint's tokenizer as a tokenizer.json backend with BERT's template."""
    tokenizer = checkpoint.load_tokenizer(directory)
    if not isinstance(tokenizer, HFTokenizer):
        tokenizer = HFTokenizer.from_sentencepiece(tokenizer)
    return tokenizer.with_bert_template()


def export_hf_encoder(directory: Path, model: EncoderOnly, out: Path) -> Path:
    """Write the checkpoint at `directory`, whose model is `model`, as OUT/ with
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json and our export
    marker; loadable with transformers' AutoModel... classes and AutoTokenizer -> OUT."""
    theirs = bert_model(model)             # checks what BERT can hold first
    tokenizer = bert_tokenizer(directory)
    specials = {"cls_token": tokenizer.bos_id, "sep_token": tokenizer.eos_id,
                "pad_token": tokenizer.pad_id,
                "mask_token": MASK_ID if tokenizer.mask_id is None else tokenizer.mask_id}
    return save_with_tokenizer_json(theirs, tokenizer, specials, model.config.max_positions,
                                    directory, out)
