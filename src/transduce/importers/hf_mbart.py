"""Hugging Face mBART-50 (MBartForConditionalGeneration directories with MBart50Tokenizer's
sentencepiece.bpe.model) -> our Transformer, with its 52 language codes.

mBART is NLLB's encoder-decoder (hf_nllb.py: pre-norm with a LayerNorm after each stack,
one vocabulary shared by both embeddings and the output, a source of [its code] + pieces
+ </s>, the decoder started from </s> and given the target's code) but for three things:

- positions are a learned table, read from row 2 on (transformers offsets them by 2, as
  fairseq counted from its pad id): rows 2.. are our positions 0..;
- each stack's input passes through a LayerNorm (layernorm_embedding): embedding_norm;
- GELU, not ReLU.

    shared / encoder.embed_tokens / decoder.embed_tokens / lm_head   (tied) the embedding
    encoder.embed_positions, decoder.embed_positions   encoder.embed.positions (rows 2..)
    encoder.layernorm_embedding, decoder.layernorm_embedding        encoder.embed.norm, ...
    encoder.layers.N.* / decoder.layers.N.*          as Marian's (hf_marian.py)
    encoder.layer_norm, decoder.layer_norm           encoder.final_norm, decoder.final_norm

The ids are fairseq's: <s>, <pad>, </s>, <unk>, then sentencepiece.bpe.model's pieces from
its fourth on, then the 52 codes (ar_AR ... sl_SI, in MBart50Tokenizer's order), then
<mask>; computed from the SentencePiece model, as MBart50Tokenizer computes them. mBART-25
(mbart-large-cc25, mbart-large-en-ro: MBartTokenizer), whose source ends with its code
and whose decoder starts from the target's, is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sentencepiece
from torch import Tensor

from transduce.importers import ForeignCheckpointError
from transduce.importers.hf_gpt2 import tokenizer_settings
from transduce.importers.hf_marian import BartWeights, model_config, read_bart_config, \
    take_bart_weights
from transduce.importers.hf_nllb import SPM_FILE, coded_vocabulary, save_coded
from transduce.importers.marian_vocabulary import MarianVocabulary

LANGUAGES = ("ar_AR cs_CZ de_DE en_XX es_XX et_EE fi_FI fr_XX gu_IN hi_IN it_IT ja_XX kk_KZ "
             "ko_KR lt_LT lv_LV my_MM ne_NP nl_XX ro_RO ru_RU si_LK tr_TR vi_VN zh_CN af_ZA "
             "az_AZ bn_IN fa_IR he_IL hr_HR id_ID ka_GE km_KH mk_MK ml_IN mn_MN mr_IN pl_PL "
             "ps_AF pt_XX sv_SE sw_KE ta_IN te_IN th_TH tl_XX uk_UA ur_PK xh_ZA gl_ES "
             "sl_SI").split()
FIXED_OPTIONS = {"tie_word_embeddings": True, "is_encoder_decoder": True}
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
SPM_SPECIALS = ("<unk>", "<s>", "</s>")       # the SentencePiece model's first three pieces
POSITION_OFFSET = 2
MBART25_TOKENIZERS = ("MBartTokenizer", "MBartTokenizerFast")


def import_mbart(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face mBART-50 directory (config.json, model.safetensors or
    pytorch_model.bin, sentencepiece.bpe.model) and write it as our checkpoint at `out`,
    replacing one there; nothing is written unless everything was read and checked.
    tokenizer_config.json's src_lang and tgt_lang, when it names both, become the
    model's default pair."""
    hf_dir, out = Path(hf_dir), Path(out)
    hf, config_file, activation = read_bart_config(hf_dir, out, "mbart", FIXED_OPTIONS, "gelu")
    vocabulary, codes, languages, unused = read_vocabulary(hf_dir, hf)
    config = model_config(hf, config_file, activation, len(vocabulary.marian_ids),
                          norm_first=True, positional="learned").replace(embedding_norm=True)
    return save_coded(hf_dir, out, hf, config, (vocabulary, codes, languages, unused),
                      map_weights, "hf-mbart")


def read_vocabulary(hf_dir: Path, hf: dict[str, Any]) -> tuple[
        MarianVocabulary, dict[str, int], tuple[str, str] | None, set[int]]:
    """As hf_nllb.read_vocabulary, of mBART-50's ids (fairseq_vocabulary)."""
    specials, options = tokenizer_settings(
        hf_dir, {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>",
                 "mask": "<mask>", "cls": None, "sep": None},
        ("src_lang", "tgt_lang", "tokenizer_class"))
    if options.get("tokenizer_class") in MBART25_TOKENIZERS:
        raise ForeignCheckpointError(
            f"{hf_dir / 'tokenizer_config.json'}: tokenizer_class="
            f"{options['tokenizer_class']!r} is mBART-25's, whose source ends with its "
            f"language code; mBART-50's (MBart50Tokenizer) is imported")
    spm_file = hf_dir / SPM_FILE
    if not spm_file.is_file():
        raise ForeignCheckpointError(f"{hf_dir}: no {SPM_FILE} (mBART-50's tokenizer "
                                     f"segments with it, and its ids follow from it)")
    vocab = fairseq_vocabulary(spm_file, specials["mask"])
    return coded_vocabulary(hf_dir, hf, vocab, {code: code for code in LANGUAGES}, spm_file,
                            specials, options)


def fairseq_vocabulary(spm_file: Path, mask: str) -> dict[str, int]:
    """piece -> mBART-50's id: fairseq's four specials, the SentencePiece model's pieces
    from its fourth on (each one id later: <pad> comes in), the codes, then `mask`."""
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(spm_file))
    except (OSError, RuntimeError) as error:
        raise ForeignCheckpointError(f"{spm_file}: unreadable ({error})") from None
    first = [processor.id_to_piece(i) for i in range(min(3, processor.get_piece_size()))]
    if tuple(first) != SPM_SPECIALS:
        raise ForeignCheckpointError(f"{spm_file}: its first pieces are {first}, not "
                                     f"{list(SPM_SPECIALS)} as mBART-50's")
    vocab = {piece: i for i, piece in enumerate(FAIRSEQ_SPECIALS)}
    for i in range(3, processor.get_piece_size()):
        vocab.setdefault(processor.id_to_piece(i), i + 1)
    after = processor.get_piece_size() + 1
    vocab.update({code: after + i for i, code in enumerate(LANGUAGES)})
    vocab[mask] = after + len(LANGUAGES)
    return vocab


def map_weights(tensors: dict[str, Tensor], config, stored_size: int, banned: set[int],
                vocabulary: MarianVocabulary, source: Path) -> dict[str, Tensor]:
    """mBART's tensors (a vocabulary of stored_size) -> our state dict (float32): the
    vocabulary reordered to ours, each key accounted for."""
    weights = BartWeights(tensors, source, config.d_model, permuted=False)
    take_bart_weights(weights, config, stored_size, banned, vocabulary, final_norms=True)
    rows = config.max_positions + POSITION_OFFSET
    for stack in ("encoder", "decoder"):
        table = weights.take(f"{stack}.embed_positions.weight", rows, config.d_model)
        weights.state[f"{stack}.embed.positions.embedding.weight"] = table[POSITION_OFFSET:]
        weights.norm(f"{stack}.embed.norm", f"{stack}.layernorm_embedding")
    return weights.all_taken()
