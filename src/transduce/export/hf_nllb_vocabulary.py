"""The tokenizer files of an NLLB, M2M-100 or mBART-50 export (hf_nllb.py): our
SentencePiece model in their layout, transformers' tokenizer over it, and which of its
ids holds which row of ours.

All number <s>, <pad>, </s>, <unk>, then the SentencePiece pieces, then the language
codes: NllbTokenizer names a code as itself (eng_Latn) and puts <mask> after them;
M2M100Tokenizer names one __en__, maps pieces to ids through vocab.json and takes its
codes from a fixed list ("m2m100" or "wmt21"), in that list's order; MBart50Tokenizer
names one as itself (en_XX), all 52 of its fixed list in that order, then <mask>.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from transduce.export.common import ExportError
from transduce.importers.hf_mbart import LANGUAGES as MBART50_LANGUAGES
from transduce.importers.hf_nllb import M2M100_LANGUAGES
from transduce.importers.marian_vocabulary import WORD_BOUNDARY

SPM_FILE = "sentencepiece.bpe.model"
# Their specials, in their order, and the ids of ours whose rows they take: <s>, where
# the export's decoder starts, takes our bos's.
THEIR_SPECIALS = {"<s>": BOS_ID, "<pad>": PAD_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
MASK = "<mask>"


class TheirCodes(NamedTuple):
    family: str                 # "NLLB", "M2M-100" or "mBART-50"
    tokens: dict[str, int]      # their token of each code -> our id
    m2m100_list: str | None     # M2M100Tokenizer's language_codes


def their_codes(codes: dict[str, int], tokenizer: Tokenizer, mbart: bool = False
                ) -> TheirCodes:
    """Our codes (code -> id) as NllbTokenizer's (each piece the code itself), as
    M2M100Tokenizer's (__en__ for en, all of them in one of its lists) or, for an mBART
    layout, as MBart50Tokenizer's (each the code itself, all of them in its list)."""
    if not codes:
        raise ExportError("cannot export to NLLB: no language codes (config.json's "
                          "language_codes; NLLB's tokenizers have them)")
    pieces = {code: tokenizer.piece(i).removeprefix(WORD_BOUNDARY) for code, i in codes.items()}
    if mbart:
        return _mbart50_codes(codes, pieces)
    if all(piece == code for code, piece in pieces.items()):
        return TheirCodes("NLLB", dict(codes), None)
    lists = [name for name, listed in M2M100_LANGUAGES.items() if set(codes) <= set(listed)]
    if lists and all(piece == f"__{code}__" for code, piece in pieces.items()):
        return TheirCodes("M2M-100", {pieces[code]: i for code, i in codes.items()},
                          min(lists, key=lambda name: len(M2M100_LANGUAGES[name])))
    code = next(code for code, piece in pieces.items() if piece != code)
    raise ExportError(f"cannot export to NLLB or M2M-100: language code {code!r} is the "
                      f"piece {pieces[code]!r}, which neither NllbTokenizer ({code}) nor "
                      f"M2M100Tokenizer (__{code}__ of its lists "
                      f"{', '.join(M2M100_LANGUAGES)}) names so")


def _mbart50_codes(codes: dict[str, int], pieces: dict[str, str]) -> TheirCodes:
    """MBart50Tokenizer's codes: its list's, each the piece of the code itself."""
    for code, piece in pieces.items():
        if code not in MBART50_LANGUAGES or piece != code:
            raise ExportError(f"cannot export to mBART-50: language code {code!r} (the piece "
                              f"{piece!r}) is not one of MBart50Tokenizer's, which names "
                              f"{', '.join(MBART50_LANGUAGES[:3])}, ... as themselves")
    return TheirCodes("mBART-50", dict(codes), None)


def left_to_the_tokenizer(tokenizer: Tokenizer, codes: TheirCodes) -> set[int]:
    """Our ids whose tokens their tokenizer adds to the SentencePiece pieces: the codes,
    and an import's <s> and <mask>."""
    named = {tokenizer.processor.piece_to_id(name) for name in ("<s>", MASK)}
    return set(codes.tokens.values()) | {i for i in named if i > UNK_ID}


def their_spm(tokenizer: Tokenizer, leave_out: set[int]) -> bytes:
    """Our SentencePiece model in NLLB's layout: <unk>, <s>, </s>, then our pieces after
    the specials, less `leave_out` (left_to_the_tokenizer's), each with its type and
    score."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    ours = model_pb2.ModelProto()
    ours.ParseFromString(tokenizer.path.read_bytes())
    kinds = model_pb2.ModelProto.SentencePiece
    theirs = model_pb2.ModelProto()
    theirs.CopyFrom(ours)
    del theirs.pieces[:]
    for piece, kind, score in (("<unk>", kinds.UNKNOWN, ours.pieces[UNK_ID].score),
                               ("<s>", kinds.CONTROL, 0.0), ("</s>", kinds.CONTROL, 0.0)):
        entry = theirs.pieces.add()
        entry.piece, entry.type, entry.score = piece, kind, score
    theirs.pieces.extend(piece for i, piece in enumerate(ours.pieces)
                         if i > UNK_ID and i not in leave_out)
    spec = theirs.trainer_spec
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    spec.unk_piece, spec.bos_piece, spec.eos_piece = "<unk>", "<s>", "</s>"
    spec.vocab_size = len(theirs.pieces)
    return theirs.SerializeToString()


def their_tokenizer(spm_model: bytes, codes: TheirCodes,
                    languages: tuple[str, str] | None, max_positions: int):
    """transformers' tokenizer of the family over `spm_model` (their_spm's) and our
    codes, `languages` (codes, as we name them) its default pair."""
    import transformers

    first = next(iter(codes.tokens))
    source, target = languages or ((first if codes.m2m100_list is None
                                    else first.strip("_")),) * 2
    options = dict(src_lang=source, tgt_lang=target, model_max_length=max_positions)
    with tempfile.TemporaryDirectory(prefix="transduce-nllb-") as scratch, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (Path(scratch) / SPM_FILE).write_bytes(spm_model)
        if codes.m2m100_list is not None:
            return transformers.M2M100Tokenizer(
                vocab_file=_write_vocab_json(spm_model, Path(scratch)),
                spm_file=str(Path(scratch) / SPM_FILE), language_codes=codes.m2m100_list,
                **options)
        if codes.family == "mBART-50":         # its codes and <mask> from its own list
            (Path(scratch) / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "MBart50Tokenizer"}), encoding="utf-8")
            return transformers.AutoTokenizer.from_pretrained(scratch, **options)
        (Path(scratch) / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "NllbTokenizer"}), encoding="utf-8")
        theirs = transformers.AutoTokenizer.from_pretrained(
            scratch, extra_special_tokens=list(codes.tokens), mask_token=None, **options)
    # <mask> after the codes, where NLLB's files and the SentencePiece NllbTokenizer put it
    theirs.add_special_tokens({"mask_token": transformers.AddedToken(
        MASK, normalized=True, lstrip=True, special=True)})
    return theirs


def _write_vocab_json(spm_model: bytes, directory: Path) -> str:
    """M2M-100's vocab.json: its specials, then the pieces of `spm_model` after its
    three -> the file's path."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto()
    proto.ParseFromString(spm_model)
    pieces = list(THEIR_SPECIALS) + [piece.piece for piece in proto.pieces[3:]]
    path = directory / "vocab.json"
    path.write_text(json.dumps({piece: i for i, piece in enumerate(pieces)},
                               ensure_ascii=False), encoding="utf-8")
    return str(path)


def rows_for(theirs, tokenizer: Tokenizer, codes: TheirCodes) -> list[int | None]:
    """Per id of `theirs`, our id of the same token (None: one we lack, such as <mask>
    or a code of M2M-100's list the model never had: a row of zeros, never output)."""
    listed = list(codes.tokens) if codes.m2m100_list is None else \
        [f"__{code}__" for code in M2M100_LANGUAGES[codes.m2m100_list]]
    # M2M100Tokenizer's get_vocab() and len() leave its codes out
    size = max([*theirs.get_vocab().values(), *theirs.convert_tokens_to_ids(listed)]) + 1
    rows: list[int | None] = []
    for token in theirs.convert_ids_to_tokens(list(range(size))):
        if token in THEIR_SPECIALS:
            rows.append(THEIR_SPECIALS[token])
        elif token in codes.tokens:
            rows.append(codes.tokens[token])
        else:
            i = tokenizer.processor.piece_to_id(token)
            rows.append(None if i == UNK_ID else i)
    return rows
