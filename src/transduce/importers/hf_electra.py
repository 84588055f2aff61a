"""Hugging Face ELECTRA (ElectraModel, ElectraForPreTraining, ElectraForMaskedLM,
ElectraForSequenceClassification, ...ForTokenClassification and ...ForQuestionAnswering
directories) -> our EncoderOnly.

ELECTRA (Clark et al. 2020) pre-trains BERT's encoder as a discriminator of replaced
tokens; fine-tuned, it is BERT's model under other names but for its sequence
classifier, whose dense layer over [CLS] is followed by GELU where BERT's pooler has
tanh (pooler_activation "gelu"):

    electra.embeddings.*, electra.encoder.layer.N.*   as BERT's (hf_bert.py)
    electra.embeddings_project       encoder.embed.project (embeddings narrower than
                                     the layers: embedding_size)
    classifier.dense                 pooler (pooler_activation "gelu")
    classifier.out_proj              classifier
    generator_predictions.dense      mlm_head.dense (a generator's masked-LM head)
    generator_predictions.LayerNorm  mlm_head.norm
    generator_lm_head.bias           mlm_head.decoder.bias (the weight: tied)

The pre-trained discriminators (ElectraForPreTraining: google/electra-base-discriminator
and the like) carry a head that tells replaced tokens, which fine-tuning replaces: it is
left unread and named in the origin ("dropped_heads"). Embeddings narrower than the
layers (embedding_size < hidden_size: ELECTRA-small's and the generators') are
projected to the layers' width after their LayerNorm, and a generator's masked-LM head
maps back to theirs (ModelConfig.embedding_size). The tokenizer is BERT's WordPiece.
"""

from __future__ import annotations

from pathlib import Path

from transduce.importers import encoder_names
from transduce.importers.hf_bert import EncoderFamily, import_encoder, read_tokenizer

MODEL_TYPES = ("electra",)


def import_electra(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face ELECTRA directory (config.json, model.safetensors or
    pytorch_model.bin, tokenizer.json or vocab.txt) and write it as our checkpoint at
    `out`, as import_bert does."""
    return import_encoder(hf_dir, out, ELECTRA)


ELECTRA = EncoderFamily(
    "hf-electra", MODEL_TYPES, encoder_names.ELECTRA, poolers=("classifier.dense",),
    mlm_prefix="generator_", mlm_dense="generator_predictions.dense",
    mlm_norm="generator_predictions.LayerNorm", mlm_biases=("generator_lm_head.bias",),
    mlm_decoder="generator_lm_head.weight", nsp=None, classifier="classifier.out_proj",
    read_tokenizer=read_tokenizer, mlm_activation="gelu",
    dropped=("discriminator_predictions",))
