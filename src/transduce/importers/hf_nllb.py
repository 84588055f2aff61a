"""Hugging Face NLLB-200 and M2M-100 (M2M100ForConditionalGeneration directories, with
NllbTokenizer's or M2M100Tokenizer's files) -> our Transformer, with its language codes.

NLLB is the paper's encoder-decoder in pre-norm: a LayerNorm before every sublayer and
one after each stack (norm_first), ReLU, token embeddings scaled by sqrt(d_model), one
vocabulary whose matrix both embeddings and the output share. What differs:

- positions are fairseq's sinusoids: all sines then all cosines, frequencies
  10000^(-k / (C/2 - 1)), counted from 2 (its pad id + 1): positional="fairseq"
  (model/positional.py), computed as NLLB computes them and never trained;
- the ids: fairseq's put <s>, <pad>, </s>, <unk> first, then the SentencePiece pieces,
  the language codes and <mask>; ours put pad, bos, eos, unk first. The vocabulary is
  merged as Marian's is (marian_vocabulary.py), bos taking the row of </s>, where NLLB's
  decoder starts, and the codes becoming pieces of their own;
- languages: a source is [its code] + pieces + </s>, and the decoder is given the
  target's code after its start. The codes and their ids are recorded in config.json
  (language_codes), and the searches give them (decode/languages.py);
- the output has no bias in NLLB; ours has one of zeros, with the tokens no translation
  contains never output (NEVER_OUTPUT): pad, bos (which repeats eos's row), <s>, <mask>
  and the language codes, which the decoder is given but never has to choose.

    shared / encoder.embed_tokens / decoder.embed_tokens / lm_head   (tied) the embedding
    encoder.layers.N.* / decoder.layers.N.*          as Marian's (hf_marian.py)
    encoder.layer_norm, decoder.layer_norm           encoder.final_norm, decoder.final_norm

The tokenizer is sentencepiece.bpe.model (the segmentation) with NLLB's tokenizer.json
(the vocabulary and the codes' ids: eng_Latn, ...), or with M2M-100's vocab.json, after
whose ids its codes follow (__en__, ... in fairseq's order of tokenizer_config.json's
language_codes, "m2m100" by default; a code is named without its underscores: en).
NLLB-MoE (model_type nllb-moe) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from transduce.importers import ForeignCheckpointError
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json, read_weights, tokenizer_settings
from transduce.importers.hf_marian import GENERATION_CONFIG, BartWeights, bad_words, \
    check_vocab, model_config, read_bart_config, save_with_vocabulary, take_bart_weights
from transduce.importers.marian_vocabulary import MarianVocabulary, merged_vocabulary
from transduce.model import empty_model
from transduce.model.positional import FAIRSEQ_OFFSET, fairseq_table

SPM_FILE, TOKENIZER_JSON, VOCAB_JSON = "sentencepiece.bpe.model", "tokenizer.json", "vocab.json"
# M2M-100's languages, in fairseq's order: the ids of their codes (__af__, ...) follow
# vocab.json's, in this order (M2M100Tokenizer's language_codes names the list).
M2M100_LANGUAGES = {
    "m2m100": ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr "
               "fy ga gd gl gu ha he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg "
               "ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc or pa pl ps pt ro ru sd si sk "
               "sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split()}
FIXED_OPTIONS = {"tie_word_embeddings": True, "is_encoder_decoder": True}
STORED_POSITIONS = ("encoder.embed_positions.weights", "decoder.embed_positions.weights")
POSITION_TOLERANCE = 1e-4


def import_nllb(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face NLLB or M2M-100 directory (config.json, model.safetensors or
    pytorch_model.bin, sentencepiece.bpe.model with tokenizer.json or vocab.json) and
    write it as our checkpoint at `out`, replacing one there; nothing is written unless
    everything was read and checked. tokenizer_config.json's src_lang and tgt_lang, when
    it names both, become the model's default pair."""
    hf_dir, out = Path(hf_dir), Path(out)
    hf, config_file, activation = read_bart_config(hf_dir, out, "m2m_100", FIXED_OPTIONS,
                                                   "relu")
    vocabulary, codes, languages, unused = read_vocabulary(hf_dir, hf)
    config = model_config(hf, config_file, activation, len(vocabulary.marian_ids),
                          norm_first=True, positional="fairseq")
    return save_coded(hf_dir, out, hf, config, (vocabulary, codes, languages, unused),
                      map_weights, "hf-nllb")


def save_coded(hf_dir: Path, out: Path, hf: dict[str, Any], config,
               read: tuple[MarianVocabulary, dict[str, int], tuple[str, str] | None, set[int]],
               mapping: Callable[..., dict[str, Tensor]], command: str) -> Path:
    """A multilingual directory's weights (NLLB's, M2M-100's, mBART's), mapped by
    mapping(tensors, config, stored size, banned ids, vocabulary, source) onto a model of
    `config`, with the codes and default pair of `read` (read_vocabulary's), saved as our
    checkpoint at `out` (its origin the import `command`)."""
    vocabulary, codes, languages, unused = read
    tensors, source = read_weights(hf_dir)
    model = empty_model(config)     # every weight is loaded next
    banned = bad_words(hf, hf_dir / GENERATION_CONFIG) | unused
    model.load_state_dict(mapping(tensors, config, hf["vocab_size"], banned, vocabulary,
                                  source))
    del tensors          # the stored files are let go before the save copies the model
    ours = {their_id: i for i, their_id in enumerate(vocabulary.marian_ids)}
    model.language_codes = {code: ours[their_id] for code, their_id in codes.items()}
    model.languages = languages
    return save_with_vocabulary(out, model, vocabulary, command, hf_dir)


def read_vocabulary(hf_dir: Path, hf: dict[str, Any]) -> tuple[
        MarianVocabulary, dict[str, int], tuple[str, str] | None, set[int]]:
    """The merged SentencePiece vocabulary, the language codes -> their ids in the
    checkpoint, the (source, target) pair tokenizer_config.json names, and the ids that
    no translation contains (the codes, <s> and <mask>)."""
    specials, options = tokenizer_settings(
        hf_dir, {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>",
                 "mask": "<mask>", "cls": None, "sep": None},
        ("src_lang", "tgt_lang", "language_codes"))
    if not (hf_dir / SPM_FILE).is_file():
        raise ForeignCheckpointError(f"{hf_dir}: no {SPM_FILE} (NLLB's and M2M-100's "
                                     f"tokenizers segment with it)")
    if (hf_dir / TOKENIZER_JSON).is_file():
        ids_file = hf_dir / TOKENIZER_JSON
        vocab, tokens = _tokenizer_vocabulary(ids_file, {t for t in specials.values() if t})
    elif (hf_dir / VOCAB_JSON).is_file():
        ids_file = hf_dir / VOCAB_JSON
        vocab, tokens = _m2m100_vocabulary(ids_file, options.get("language_codes", "m2m100"))
    else:
        raise ForeignCheckpointError(f"{hf_dir}: no {TOKENIZER_JSON} (NLLB's) or "
                                     f"{VOCAB_JSON} (M2M-100's) beside {SPM_FILE}")
    if not tokens:
        raise ForeignCheckpointError(f"{ids_file}: no language codes among its added tokens")
    return coded_vocabulary(hf_dir, hf, vocab, tokens, ids_file, specials, options)


def coded_vocabulary(hf_dir: Path, hf: dict[str, Any], vocab: dict[str, int],
                     tokens: dict[str, str], ids_file: Path, specials: dict[str, str | None],
                     options: dict[str, Any]) -> tuple[
        MarianVocabulary, dict[str, int], tuple[str, str] | None, set[int]]:
    """What read_vocabulary returns, of fairseq's ids (`vocab`: piece -> id, read from
    ids_file) and the language codes' tokens (code -> token), checked against config.json:
    NLLB's, M2M-100's and mBART-50's vocabularies alike."""
    named = {role: specials[role] for role in ("eos", "unk", "pad")}
    check_vocab(vocab, hf, ids_file, hf_dir / HF_CONFIG, named)
    start = hf.get("decoder_start_token_id", vocab[named["eos"]])
    if not isinstance(start, int) or start not in set(vocab.values()):
        raise ForeignCheckpointError(f"{hf_dir / HF_CONFIG}: decoder_start_token_id={start!r} "
                                     f"is not an id of {ids_file.name}")
    vocabulary = merged_vocabulary(hf_dir / SPM_FILE, None, vocab, **named,
                                   decoder_start=start, codes=frozenset(tokens.values()))
    codes = {code: vocab[token] for code, token in tokens.items()}
    pair = options.get("src_lang"), options.get("tgt_lang")
    languages = pair if all(language in codes for language in pair) else None
    unused = set(codes.values()) | {vocab[specials[role]] for role in ("bos", "mask")
                                    if specials[role] in vocab}
    return vocabulary, codes, languages, unused


def _m2m100_vocabulary(file: Path, which: Any) -> tuple[dict[str, int], dict[str, str]]:
    """M2M-100's vocab.json -> (every piece -> its id, with the codes after vocab.json's
    ids in fairseq's order; each code -> its token: en -> __en__)."""
    if which not in M2M100_LANGUAGES:
        raise ForeignCheckpointError(f"{file.parent / 'tokenizer_config.json'}: "
                                     f"language_codes={which!r}; M2M-100's are "
                                     f"{' or '.join(map(repr, M2M100_LANGUAGES))}")
    vocab = _read_json(file)
    tokens = {code: f"__{code}__" for code in M2M100_LANGUAGES[which]}
    first = len(vocab)
    vocab.update({token: first + i for i, token in enumerate(tokens.values())})
    return vocab, tokens


def _tokenizer_vocabulary(file: Path, specials: set[str]
                          ) -> tuple[dict[str, int], dict[str, str]]:
    """NLLB's tokenizer.json -> (every piece -> its id: the model's vocabulary and the
    added tokens; each language code -> its token, the code itself: the added special
    tokens that are none of `specials`)."""
    values = _read_json(file)
    model, added = values.get("model"), values.get("added_tokens")
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict) or \
            not isinstance(added, list) or \
            not all(isinstance(token, dict) and isinstance(token.get("content"), str)
                    and isinstance(token.get("id"), int) for token in added):
        raise ForeignCheckpointError(f"{file}: expected a \"model\" with a \"vocab\" and "
                                     f"\"added_tokens\" with ids")
    vocab = dict(model["vocab"])
    vocab.update({token["content"]: token["id"] for token in added})
    codes = {token["content"]: token["content"] for token in added
             if token.get("special") and token["content"] not in specials}
    return vocab, codes


def map_weights(tensors: dict[str, Tensor], config, nllb_size: int, banned: set[int],
                vocabulary: MarianVocabulary, source: Path) -> dict[str, Tensor]:
    """NLLB's tensors (a vocabulary of nllb_size) -> our state dict (float32): the
    vocabulary reordered to ours, each key accounted for."""
    weights = BartWeights(tensors, source, config.d_model, permuted=False)
    take_bart_weights(weights, config, nllb_size, banned, vocabulary, final_norms=True)
    _check_stored_positions(weights, config)
    return weights.all_taken()


def _check_stored_positions(weights: BartWeights, config) -> None:
    """Position tables that older transformers saved must hold fairseq's sinusoids (their
    rows from 2 on, which are our positions from 0; rows 0 and 1 are never read)."""
    table = fairseq_table(config.max_positions, config.d_model)
    for name in STORED_POSITIONS:
        if name in weights.names:
            stored = weights.tensors[weights.names.pop(name)]
            rows = min(stored.shape[0] - FAIRSEQ_OFFSET, table.shape[0])
            if stored.dim() != 2 or stored.shape[1] != table.shape[1] or not torch.allclose(
                    stored[FAIRSEQ_OFFSET:FAIRSEQ_OFFSET + rows].float(), table[:rows],
                    atol=max(POSITION_TOLERANCE, torch.finfo(stored.dtype).eps), rtol=0):
                raise ForeignCheckpointError(f"{weights.source}: {name!r} is not the "
                                             f"sinusoidal table NLLB computes")
