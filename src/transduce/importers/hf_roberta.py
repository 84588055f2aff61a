"""Hugging Face RoBERTa, XLM-RoBERTa and CamemBERT (RobertaModel, RobertaForMaskedLM,
RobertaForSequenceClassification and their XLM-R / CamemBERT twins) -> our EncoderOnly.

RoBERTa is BERT's model trained another way: the same post-norm layers under the same
names (hf_bert.py's table), with one segment type (type_vocab_size 1), LayerNorm eps
1e-5, and no next-sentence head. Three things differ in the files:

    positions     counted from pad_token_id + 1 (rows 0 and 1 of the table serve no real
                  token), so the table is read from that row on: max_positions is
                  max_position_embeddings - pad_token_id - 1 (512 for roberta-base)
    lm_head       dense, layer_norm, decoder (tied to the word embeddings) and bias: the
                  masked-LM head, as BERT's cls.predictions, but with exact GELU whatever
                  hidden_act says (ours follows hidden_act: another one is refused)
    classifier    dense + tanh over <s>, then out_proj: our pooler and classifier, which
                  compute the same (RoBERTa's dropout before the dense layer aside, which
                  only training sees)

The tokenizer is the checkpoint's: its tokenizer.json (byte-level BPE for RoBERTa,
SentencePiece's unigram for XLM-R and CamemBERT), or RoBERTa's vocab.json + merges.txt;
<s> A </s>, with <s> as bos ([CLS]), </s> as eos ([SEP]), <pad> and <mask>.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transduce.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer
from transduce.data.tokenizer import TokenizerError
from transduce.importers import ForeignCheckpointError, encoder_names
from transduce.importers.hf_bert import EncoderFamily, import_encoder
from transduce.importers.hf_gpt2 import MERGES, VOCAB_JSON, tokenizer_settings

MODEL_TYPES = ("roberta", "xlm-roberta", "camembert")
DEFAULT_PAD_ID = 1     # RobertaConfig's pad_token_id


def import_roberta(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face RoBERTa, XLM-RoBERTa or CamemBERT directory (config.json,
    model.safetensors or pytorch_model.bin, tokenizer.json or vocab.json + merges.txt)
    and write it as our checkpoint at `out`, as import_bert does (heads it lacks fresh,
    and named in the origin)."""
    return import_encoder(hf_dir, out, ROBERTA)


def read_tokenizer(hf_dir: Path) -> HFTokenizer:
    """The directory's tokenizer.json, else its vocab.json + merges.txt (byte-level BPE,
    add_prefix_space as tokenizer_config.json says, False by default), with the special
    tokens tokenizer_config.json / special_tokens_map.json name (RoBERTa's defaults)
    and RoBERTa's template."""
    specials, options = tokenizer_settings(
        hf_dir, {"cls": "<s>", "sep": "</s>", "pad": "<pad>", "mask": "<mask>",
                 "unk": "<unk>"}, ("add_prefix_space",))
    try:
        if (hf_dir / TOKENIZER_JSON).is_file():
            tokenizer = HFTokenizer.from_file(hf_dir / TOKENIZER_JSON, bos=specials["cls"],
                                              eos=specials["sep"], pad=specials["pad"])
            tokenizer = tokenizer.with_mask(specials["mask"])
        elif (hf_dir / VOCAB_JSON).is_file() and (hf_dir / MERGES).is_file():
            tokenizer = HFTokenizer.from_byte_level_bpe(
                hf_dir / VOCAB_JSON, hf_dir / MERGES, bos=specials["cls"],
                eos=specials["sep"], pad=specials["pad"], mask=specials["mask"],
                unk=specials["unk"],
                add_prefix_space=bool(options.get("add_prefix_space", False)))
        else:
            raise ForeignCheckpointError(
                f"{hf_dir}: no tokenizer ({TOKENIZER_JSON}, or {VOCAB_JSON} + {MERGES}); an "
                f"XLM-R or CamemBERT directory with only its SentencePiece model can be given "
                f"one by transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
    except TokenizerError as error:
        raise ForeignCheckpointError(str(error)) from None
    return tokenizer if tokenizer.prepend_bos else tokenizer.with_roberta_template()


def position_offset(hf: dict[str, Any]) -> int:
    """The table row of position 0: pad_token_id + 1."""
    pad = hf.get("pad_token_id", DEFAULT_PAD_ID)
    return (DEFAULT_PAD_ID if pad is None else pad) + 1


ROBERTA = EncoderFamily(
    "hf-roberta", MODEL_TYPES, encoder_names.ROBERTA,
    poolers=("pooler.dense", "classifier.dense"),
    mlm_prefix="lm_head.", mlm_dense="lm_head.dense", mlm_norm="lm_head.layer_norm",
    mlm_biases=("lm_head.bias", "lm_head.decoder.bias"), mlm_decoder="lm_head.decoder.weight",
    nsp=None, classifier="classifier.out_proj", read_tokenizer=read_tokenizer,
    position_offset=position_offset, mlm_activation="gelu")
