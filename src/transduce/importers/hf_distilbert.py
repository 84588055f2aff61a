"""Hugging Face DistilBERT (DistilBertModel, DistilBertForMaskedLM or
DistilBertForSequenceClassification directories) -> our EncoderOnly.

DistilBERT (Sanh et al. 2019) is BERT's encoder with half the layers, distilled: the same
post-norm layers, learned positions and embedding LayerNorm, but no segment embeddings
(type_vocab_size 0) and, in the sequence classifier, a ReLU after the dense layer over
[CLS] (its pre_classifier) where BERT's pooler has tanh. Its layers' weights go under
other names (encoder_names.DISTILBERT_LAYER), its heads as:

    pre_classifier                    pooler (pooler_activation "relu")
    classifier                        classifier
    vocab_transform                   mlm_head.dense
    vocab_layer_norm                  mlm_head.norm
    vocab_projector.bias              mlm_head.decoder.bias (the weight: tied)

Its config.json names BertConfig's fields otherwise ("dim", "n_layers", "n_heads",
"hidden_dim", "activation"), and its LayerNorms take eps 1e-12 whatever it says. The
rest is hf_bert.py's: the checks, the fresh heads, the tokenizer (BERT's WordPiece), a
sentence-transformers directory's pooling.
"""

from __future__ import annotations

from pathlib import Path

from transduce.importers import encoder_names
from transduce.importers.hf_bert import EncoderFamily, import_encoder, read_tokenizer

MODEL_TYPES = ("distilbert",)
# BertConfig's keys -> DistilBertConfig's.
CONFIG_KEYS = {"hidden_size": "dim", "num_attention_heads": "n_heads",
               "num_hidden_layers": "n_layers", "intermediate_size": "hidden_dim",
               "hidden_act": "activation", "hidden_dropout_prob": "dropout",
               "attention_probs_dropout_prob": "attention_dropout",
               "layer_norm_eps": None}    # not read: fixed at 1e-12, BERT's default


def import_distilbert(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face DistilBERT directory (config.json, model.safetensors or
    pytorch_model.bin, tokenizer.json or vocab.txt) and write it as our checkpoint at
    `out`, as import_bert does."""
    return import_encoder(hf_dir, out, DISTILBERT)


DISTILBERT = EncoderFamily(
    "hf-distilbert", MODEL_TYPES, encoder_names.DISTILBERT, poolers=("pre_classifier",),
    mlm_prefix="vocab_", mlm_dense="vocab_transform", mlm_norm="vocab_layer_norm",
    mlm_biases=("vocab_projector.bias",), mlm_decoder="vocab_projector.weight", nsp=None,
    classifier="classifier", read_tokenizer=read_tokenizer, keys=CONFIG_KEYS)
