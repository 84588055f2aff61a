"""Hugging Face ELECTRA (ElectraModel, ElectraForPreTraining, ElectraForMaskedLM,
ElectraForSequenceClassification, ...ForTokenClassification and ...ForQuestionAnswering
directories) -> our EncoderOnly.

ELECTRA (Clark et al. 2020) pre-trains BERT's encoder as a discriminator of replaced
tokens; fine-tuned, it is BERT's model under other names but for its sequence
classifier, whose dense layer over [CLS] is followed by GELU where BERT's pooler has
tanh (pooler_activation "gelu"):

    electra.embeddings.*, electra.encoder.layer.N.*   as BERT's (hf_bert.py)
    classifier.dense                 pooler (pooler_activation "gelu")
    classifier.out_proj              classifier
    generator_predictions.dense      mlm_head.dense (a generator's masked-LM head)
    generator_predictions.LayerNorm  mlm_head.norm
    generator_lm_head.bias           mlm_head.decoder.bias (the weight: tied)

The pre-trained discriminators (ElectraForPreTraining: google/electra-base-discriminator
and the like) carry a head that tells replaced tokens, which fine-tuning replaces: it is
left unread and named in the origin ("dropped_heads"). A model whose embeddings are
narrower than its layers (embedding_size < hidden_size, ELECTRA-small's and the
generators', projected by embeddings_project) is refused by name: ours embeds at the
layers' width. The tokenizer is BERT's WordPiece.
"""

from __future__ import annotations

from pathlib import Path

from transduce.importers import ForeignCheckpointError, encoder_names
from transduce.importers.hf_bert import EncoderFamily, import_encoder, read_tokenizer
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json

MODEL_TYPES = ("electra",)


def import_electra(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face ELECTRA directory (config.json, model.safetensors or
    pytorch_model.bin, tokenizer.json or vocab.txt) and write it as our checkpoint at
    `out`, as import_bert does."""
    config_file = Path(hf_dir) / HF_CONFIG
    if config_file.is_file():
        hf = _read_json(config_file)
        width, embedding = hf.get("hidden_size"), hf.get("embedding_size", hf.get("hidden_size"))
        if embedding != width:
            raise ForeignCheckpointError(
                f"{config_file}: embedding_size={embedding} but hidden_size={width}: its "
                f"embeddings are projected to the layers' width (ELECTRA-small's, a "
                f"generator's), which ours has no place for; an ELECTRA of equal sizes "
                f"(electra-base, electra-large) is imported")
    return import_encoder(hf_dir, out, ELECTRA)


ELECTRA = EncoderFamily(
    "hf-electra", MODEL_TYPES, encoder_names.ELECTRA, poolers=("classifier.dense",),
    mlm_prefix="generator_", mlm_dense="generator_predictions.dense",
    mlm_norm="generator_predictions.LayerNorm", mlm_biases=("generator_lm_head.bias",),
    mlm_decoder="generator_lm_head.weight", nsp=None, classifier="classifier.out_proj",
    read_tokenizer=read_tokenizer, mlm_activation="gelu",
    keys={"embedding_size": None}, dropped=("discriminator_predictions",))
