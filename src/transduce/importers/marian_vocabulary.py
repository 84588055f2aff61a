"""A Marian checkpoint's tokenizer as SentencePiece models with our special ids.

MarianTokenizer (transformers) segments a source with source.spm, maps each piece to an
id through vocab.json (a piece the vocabulary lacks is <unk>), and appends </s>; a
leading language code such as >>fra<< (multilingual targets) is one token. Its ids put
</s> and <unk> first and <pad>, where the decoder starts, last. Our models read one
SentencePiece model whose ids are pad 0, bos 1, eos 2, unk 3 (data/tokenizer.py), so
the import writes one:

- ids 0-3 are <pad>, the bos, Marian's </s> and <unk>; then every other piece of
  vocab.json in Marian's order. Each id of ours takes the embedding row of a Marian id
  (`marian_ids`): bos the decoder's start token's (and its name, unless that is <pad>:
  then <s>), pad Marian's pad.
- pieces source.spm has keep its type and score, and its normalizer, so a source is
  segmented as source.spm segments it; pieces only the targets use (a joint
  vocabulary's) are UNUSED: SentencePiece decodes them but never produces them.
- a language code is a user-defined piece with the word boundary before it, so that
  ">>fra<< text" gives the code and then the pieces of " text", as Marian's does.

A piece of source.spm that vocab.json lacks is left out (`dropped`): SentencePiece then
segments with the pieces the model knows where MarianTokenizer would give <unk>.

Targets are segmented by target.spm (MarianTokenizer's text_target), which a fine-tuning
run's references must follow: `target_model` has the same pieces under the same ids with
target.spm's types, scores and normalizer (None where it equals the source model). Either
decodes an output: decoding concatenates the pieces.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transduce.importers import ForeignCheckpointError

LANGUAGE_CODE = re.compile(r"^>>\S+<<$")
BOS_NAMES = ("<s>", "<bos>", "<start>")       # the first one vocab.json does not use
WORD_BOUNDARY = "\u2581"                      # SentencePiece's "▁"
BYTE_PIECES = 256
_KNOWN_TYPES = (1, 4, 6)      # ModelProto.SentencePiece's NORMAL, USER_DEFINED and BYTE


@dataclass
class MarianVocabulary:
    model: bytes                # the SentencePiece model of sources, serialized
    target_model: bytes | None  # the same pieces segmenting as target.spm does, if it differs
    marian_ids: list[int]       # per id of ours, the Marian id whose rows it takes
    dropped: int                # pieces of source.spm that vocab.json lacks


def merged_vocabulary(source_spm: Path, target_spm: Path | None, vocab: dict[str, int], *,
                      eos: str, unk: str, pad: str, decoder_start: int,
                      codes: frozenset[str] | None = None) -> MarianVocabulary:
    """source.spm, target.spm (None: none) and vocab.json (piece -> Marian id) as
    SentencePiece models of ours (see the module's note). eos, unk, pad: Marian's special
    pieces; decoder_start: the Marian id the decoder starts from; codes: the pieces that
    are language codes (None: those named as Marian names them, >>fra<<)."""
    specials = {eos: EOS_ID, unk: UNK_ID, pad: PAD_ID}
    start = next(piece for piece, marian_id in vocab.items() if marian_id == decoder_start)
    if start not in specials:      # a bos of its own (our Marian exports'): it stays one
        bos = start
    else:
        bos = next((name for name in BOS_NAMES if name not in vocab), None)
        if bos is None:
            raise ForeignCheckpointError(f"vocab.json uses every name of ours for bos "
                                         f"({', '.join(BOS_NAMES)})")
    specials[bos] = BOS_ID
    rest = [piece for _, piece in sorted((marian_id, piece) for piece, marian_id in vocab.items()
                                         if piece not in specials)]
    named = {"pad": pad, "bos": bos, "eos": eos, "unk": unk}
    source = _read_model(source_spm)
    is_code = (lambda piece: LANGUAGE_CODE.match(piece) is not None) if codes is None \
        else codes.__contains__
    model = _merged_model(source, source_spm, rest, named, is_code)
    target_model = None
    if target_spm is not None:
        target_model = _merged_model(_read_model(target_spm), target_spm, rest, named, is_code)
        target_model = None if target_model == model else target_model
    dropped = sum(not _in_vocabulary(piece.piece, vocab) for piece in source.pieces
                  if piece.type in _KNOWN_TYPES)
    marian_ids = [vocab[pad], decoder_start, vocab[eos], vocab[unk]] + [vocab[p] for p in rest]
    return MarianVocabulary(model, target_model, marian_ids, dropped)


def _in_vocabulary(piece: str, vocab: dict[str, int]) -> bool:
    """Whether vocab.json has the piece; a language code with the word boundary before
    it (ours, in the source.spm of our Marian exports) under its plain name."""
    code = piece.removeprefix(WORD_BOUNDARY)
    return piece in vocab or (LANGUAGE_CODE.match(code) is not None and code in vocab)


def _read_model(path: Path):
    """A SentencePiece model file -> its ModelProto."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    model = model_pb2.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())
    except (OSError, ValueError) as error:
        raise ForeignCheckpointError(f"{path}: not a readable SentencePiece model "
                                     f"({error})") from None
    return model


def _merged_model(spm_model, path: Path, rest: list[str], named: dict[str, str],
                  is_code: Callable[[str], bool]) -> bytes:
    """spm_model (read from `path`) with our pieces: the specials `named` (pad, bos, eos,
    unk) under our ids, then `rest` in order, each with its type and score where
    spm_model has it, a language code user-defined, any other UNUSED -> serialized."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    kinds = model_pb2.ModelProto.SentencePiece
    known = {piece.piece: piece for piece in spm_model.pieces if piece.type in _KNOWN_TYPES}
    keeps_bytes = spm_model.trainer_spec.byte_fallback and \
        sum(known[piece].type == kinds.BYTE for piece in rest if piece in known) == BYTE_PIECES
    merged = model_pb2.ModelProto()
    merged.CopyFrom(spm_model)
    del merged.pieces[:]

    def add(piece: str, kind: int, score: float = 0.0) -> None:
        entry = merged.pieces.add()
        entry.piece, entry.type, entry.score = piece, kind, score

    unknown_score = next((p.score for p in spm_model.pieces if p.type == kinds.UNKNOWN), 0.0)
    add(named["pad"], kinds.CONTROL)
    add(named["bos"], kinds.CONTROL)
    add(named["eos"], kinds.CONTROL)
    add(named["unk"], kinds.UNKNOWN, unknown_score)
    boundary = WORD_BOUNDARY if spm_model.normalizer_spec.add_dummy_prefix else ""
    for piece in rest:
        entry = known.get(piece)
        if is_code(piece):
            add(boundary + piece, kinds.USER_DEFINED)
        elif entry is None or (entry.type == kinds.BYTE and not keeps_bytes):
            add(piece, kinds.UNUSED)
        else:
            add(piece, entry.type, entry.score)
    spec = merged.trainer_spec
    spec.pad_id, spec.bos_id, spec.eos_id, spec.unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID
    spec.pad_piece, spec.bos_piece = named["pad"], named["bos"]
    spec.eos_piece, spec.unk_piece = named["eos"], named["unk"]
    spec.vocab_size, spec.byte_fallback = len(merged.pieces), keeps_bytes
    model = merged.SerializeToString()
    try:
        spm.SentencePieceProcessor(model_proto=model)
    except (RuntimeError, OSError) as error:
        raise ForeignCheckpointError(f"{path} with its vocabulary does not make a "
                                     f"SentencePiece model ({error})") from None
    return model
