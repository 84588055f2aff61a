"""The BPE vocabularies: shared (the paper's "shared source-target vocabulary") or one
per side.

By default one SentencePiece BPE model is trained on both sides of the training data, so
that the source embedding, target embedding and output projection can share one matrix.
Languages that share little (other scripts: English and Chinese, Russian, Arabic) can
have a vocabulary each instead (`transduce vocab --separate`): spm.model segments the
sources and spm-target.model the targets, each with its own pieces and ids, and the
model ties only the target embedding to the output projection. Each model is trained
for a lossless round trip: no normalisation, whitespace kept as it is, and byte fallback
for characters never seen in training, so decode(encode(text)) == text.

Special ids are fixed for every vocabulary:
    PAD_ID = 0   padding (ModelConfig.pad_id)
    BOS_ID = 1   begins every decoder input
    EOS_ID = 2   ends every source and every target
    UNK_ID = 3   never produced with byte fallback, kept for SentencePiece
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np
import sentencepiece as spm

from transduce import atomic
from transduce.errors import TransduceError

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_NAME = "spm.model"
# Beside spm.model, the targets' tokenizer when it is another: a separate vocabulary (its
# own pieces and ids), or another segmentation of the same pieces under the same ids (an
# imported Marian model's target.spm: other scores and normalizer).
TARGET_MODEL_NAME = "spm-target.model"
# Below this many texts, encode() takes them one by one: SentencePiece encodes a list on
# a pool of threads that it starts per call, which cost 57 us of CPU for one sentence
# against 6.5 one by one, and more CPU up to 64 sentences (2-core Zen 4).
THREADED_FROM = 32


class TokenizerError(TransduceError, RuntimeError):
    """The vocabulary cannot be trained or loaded; the message says why."""


class TextTokenizer(Protocol):
    """What models, searches and commands need of a tokenizer: SentencePiece for the
    models trained here (Tokenizer), byte-level BPE or WordPiece through the `tokenizers`
    library for imported checkpoints."""

    path: Path
    fingerprint: str
    prepend_bos: bool   # whether sequences start with bos (a language model's prompts)

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> ids, without specials."""

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, stopping at the first eos; pad and bos skipped."""


class CachedEncoding:
    """encode_cached() for a tokenizer with encode() and a fingerprint (SentencePiece's
    and the `tokenizers` library's alike)."""

    def encode_cached(self, texts: Sequence[str], cache_dir: Path) -> list[np.ndarray]:
        """encode(), remembered on disk by (tokenizer, text) fingerprint, so that a corpus
        is tokenised once, not on every run."""
        digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()[:16]
        path = cache_dir / f"{self.fingerprint}-{digest}.npz"
        if path.is_file():
            try:
                with np.load(path) as stored:
                    return np.split(stored["ids"], stored["offsets"][1:-1])
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                pass  # a damaged cache entry: encode again and rewrite it
        encoded = self.encode(texts)
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        flat = np.fromiter((t for ids in encoded for t in ids), dtype=np.int32, count=int(offsets[-1]))
        with atomic.atomic_file(path) as temporary, open(temporary, "wb") as handle:
            np.savez(handle, ids=flat, offsets=offsets)
        return np.split(flat, offsets[1:-1])


class Tokenizer(CachedEncoding):
    """Text <-> ids with a SentencePiece model file."""

    bos_id, eos_id, pad_id, unk_id = BOS_ID, EOS_ID, PAD_ID, UNK_ID
    prepend_bos = True   # models trained here read [bos] + ids

    def __init__(self, model_path: Path | str):
        self.path = Path(model_path)
        if not self.path.is_file():
            raise TokenizerError(f"{self.path}: no such SentencePiece model; create one with "
                                 f"`transduce vocab --data DIR`")
        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as error:
            raise TokenizerError(f"{self.path}: not a readable SentencePiece model "
                                 f"({str(error).strip() or type(error).__name__})") from None
        specials = (self.processor.pad_id(), self.processor.bos_id(),
                    self.processor.eos_id(), self.processor.unk_id())
        if specials != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise TokenizerError(f"{self.path}: special ids (pad, bos, eos, unk) are {specials}, "
                                 f"expected {(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}")
        self.target_tokenizer = self._target_side()
        self.separate = self.target_tokenizer is not self and not _same_pieces(
            self.processor, self.target_tokenizer.processor)
        # What the file held when read: a checkpoint saved later writes these bytes, even
        # where the file has gone since (a resumed run's first checkpoint, removed by
        # keep_last while the run still reads it).
        self.model_bytes = self.path.read_bytes()
        # the file's hash; with a target side, one of both (its fingerprint, not a re-read)
        both = self.model_bytes + (b"" if self.target_tokenizer is self
                                   else self.target_tokenizer.fingerprint.encode())
        self.fingerprint = hashlib.sha256(both).hexdigest()[:16]

    def _target_side(self) -> "Tokenizer":
        """The tokenizer of target sentences (training's references, the model's outputs):
        the spm-target.model beside this spm.model, else this one. Whether the model
        expects a separate vocabulary or the same pieces is its config's to say
        (check_vocabularies)."""
        sibling = self.path.with_name(TARGET_MODEL_NAME)
        if self.path.name != MODEL_NAME or not sibling.is_file():
            return self
        return Tokenizer(sibling)

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> ids, without specials."""
        if len(texts) < THREADED_FROM:
            return [self.processor.encode(text, out_type=int) for text in texts]
        return self.processor.encode(list(texts), out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text: stops at the first eos; pad and bos are skipped."""
        pieces = []
        for token in ids:
            if token == EOS_ID:
                break
            if token not in (PAD_ID, BOS_ID):
                pieces.append(int(token))
        return self.processor.decode(pieces)

    def piece(self, token_id: int) -> str:
        """The piece of one id ("<s>", "</s>" for bos and eos), for display."""
        return self.processor.id_to_piece(int(token_id))


def _same_pieces(one: spm.SentencePieceProcessor, other: spm.SentencePieceProcessor) -> bool:
    ids = list(range(one.get_piece_size()))
    return one.get_piece_size() == other.get_piece_size() and \
        one.id_to_piece(ids) == other.id_to_piece(ids)


def check_vocabularies(tokenizer: TextTokenizer, src_vocab_size: int, tgt_vocab_size: int,
                       shared: bool) -> None:
    """A model's embedding sizes against the vocabularies it reads and writes; shared:
    whether one matrix embeds both sides (tie_embeddings "all" or "embeddings"), which
    needs one vocabulary. A TokenizerError names the file and what differs."""
    target = getattr(tokenizer, "target_tokenizer", tokenizer)
    if shared and getattr(tokenizer, "separate", False):
        raise TokenizerError(f"{target.path}: a separate target vocabulary (other pieces "
                             f"than {tokenizer.path}), but the model shares one matrix "
                             f"between both sides (tie_embeddings='all'); remove it, or "
                             f"train a model with tie_embeddings='decoder'")
    for side, size, vocabulary in (("src", src_vocab_size, tokenizer),
                                   ("tgt", tgt_vocab_size, target)):
        if size != vocabulary.vocab_size:
            raise TokenizerError(f"{vocabulary.path}: {vocabulary.vocab_size} pieces, but the "
                                 f"model has {side}_vocab_size={size}")


def train_tokenizer(texts: Iterable[str], model_dir: Path, vocab_size: int,
                    target_texts: Iterable[str] | None = None,
                    target_size: int | None = None) -> Tokenizer:
    """Train a BPE model on the texts -> model_dir/spm.model: both languages' for a shared
    vocabulary, or, given target_texts, the sources' with a separate vocabulary of
    target_size pieces (default vocab_size) trained on the targets as spm-target.model.
    Both are trained before either is written; a shared vocabulary removes an earlier
    separate one's target side."""
    model_dir.mkdir(parents=True, exist_ok=True)
    sides = [(Path(MODEL_NAME).stem, texts, vocab_size)]
    if target_texts is not None:
        sides.append((Path(TARGET_MODEL_NAME).stem, target_texts, target_size or vocab_size))
    with tempfile.TemporaryDirectory(dir=model_dir, prefix=".tmp-spm-") as scratch:
        for stem, side_texts, size in sides:
            _train_bpe(side_texts, Path(scratch) / stem, size, model_dir / f"{stem}.model")
        if target_texts is None:
            for suffix in (".model", ".vocab"):
                (model_dir / f"{Path(TARGET_MODEL_NAME).stem}{suffix}").unlink(missing_ok=True)
        for stem, _, _ in sides:
            for suffix in (".model", ".vocab"):
                with atomic.atomic_file(model_dir / f"{stem}{suffix}") as temporary:
                    shutil.move(Path(scratch) / f"{stem}{suffix}", temporary)
    return Tokenizer(model_dir / MODEL_NAME)


def _train_bpe(texts: Iterable[str], prefix: Path, vocab_size: int, goal: Path) -> None:
    """SentencePiece BPE for a lossless round trip -> prefix.model, prefix.vocab (to become
    `goal`, which an error names)."""
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=str(prefix), model_type="bpe",
            vocab_size=vocab_size, character_coverage=1.0, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
            input_sentence_size=0, shuffle_input_sentence=False, num_threads=2,
            minloglevel=2)
    except RuntimeError as error:
        raise TokenizerError(f"{goal}: SentencePiece could not train a {vocab_size}-token "
                             f"vocabulary: {error}") from None
