"""Tokenizers of imported checkpoints, through the Hugging Face `tokenizers` library.

Models trained here use SentencePiece (tokenizer.py); a model imported from Hugging
Face must see exactly the ids it was trained on, so its own tokenizer is used as it is:
a `tokenizer.json` (any model the library describes: byte-level BPE for GPT-2,
WordPiece for BERT), GPT-2's older pair `vocab.json` + `merges.txt`, assembled here
into the byte-level BPE that `transformers.GPT2TokenizerFast` builds from them, or
BERT's `vocab.txt`, assembled into the WordPiece pipeline of `transformers.BertTokenizerFast`
(BERT normalizer, BERT pre-tokenizer, WordPiece with "##" continuations and [UNK]).
The other way, a language model's export writes our SentencePiece model as a
tokenizer.json of the same ids (`from_sentencepiece`, Llama 2's layout).

A tokenizer.json does not say which of its tokens begin or end a text or pad a batch
(Hugging Face keeps that in tokenizer_config.json and the model's config.json), so the
special ids are given to the constructors, and a checkpoint records them beside the
file (checkpoint.py). They may coincide: GPT-2 uses `<|endoftext|>` for all three;
BERT's are [CLS] (bos), [SEP] (eos) and [PAD]. Its [MASK] and [UNK] need no record:
`mask_id` is the special token the tokenizer.json calls [MASK] (or <mask>), `unk_id`
the unknown token of its model.

encode() never adds specials; `prepend_bos` says whether a sequence starts with bos,
and follows the tokenizer's own post-processor (what Hugging Face adds with
add_special_tokens=True): False for GPT-2, which adds nothing, True for BERT, whose
sequences are [CLS] A [SEP]; the caller adds bos (and, for BERT, the [SEP]s).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Sequence

from transduce import atomic
from transduce.data.tokenizer import CachedEncoding, TokenizerError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as Backend

    from transduce.data.chat import ChatTemplate
    from transduce.data.tokenizer import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
ADDED_TOKENS_JSON = "added_tokens.json"     # beside vocab.json + merges.txt: more tokens
SPECIALS = ("bos_id", "eos_id", "pad_id")
MASK_TOKENS = ("[MASK]", "<mask>")   # how BERT and RoBERTa name their mask token

Special = int | str   # an id, or a token resolved to its id by the vocabulary


def _tokenizers() -> ModuleType:
    """The `tokenizers` library, imported when first needed: only imported checkpoints
    use it, so the rest of the package (checkpoint.py included) works without it."""
    try:
        return importlib.import_module("tokenizers")
    except ImportError:
        raise TokenizerError("a Hugging Face tokenizer needs the `tokenizers` package "
                             "(pip install tokenizers)") from None


WORD_START = "\u2581"     # SentencePiece's "▁", which stands for a space


def _check_llama_like(tokenizer: "Tokenizer") -> None:
    """What HFTokenizer.from_sentencepiece writes out exactly: the model `transduce vocab`
    trains (BPE, byte fallback, identity normalization, whitespace kept, a space put
    first)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.processor.serialized_model_proto())
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    settings = {"model_type": (trainer.model_type, trainer.BPE),
                "byte_fallback": (trainer.byte_fallback, True),
                "normalization": (normalizer.name, "identity"),
                "remove_extra_whitespaces": (normalizer.remove_extra_whitespaces, False),
                "add_dummy_prefix": (normalizer.add_dummy_prefix, True)}
    wrong = [f"{name}={have!r}" for name, (have, want) in settings.items() if have != want]
    if wrong:
        raise TokenizerError(f"{tokenizer.path}: cannot be written as a tokenizer.json "
                             f"({', '.join(wrong)}; only the BPE models `transduce vocab` "
                             f"trains)")


class HFTokenizer(CachedEncoding):
    """Text <-> ids with a `tokenizers.Tokenizer`; implements TextTokenizer.

    path: the file it was read from (tokenizer.json, or vocab.json of a BPE pair);
    save() writes it as one tokenizer.json whichever it was.
    """

    def __init__(self, backend: "Backend", path: Path, *, bos: Special, eos: Special,
                 pad: Special | None = None, mask: Special | None = None,
                 prepend_bos: bool | None = None):
        self.backend, self.path = backend, Path(path)
        # Batches are padded and truncated by the caller; a tokenizer.json saved with
        # either enabled would otherwise change what encode() returns.
        backend.no_padding()
        backend.no_truncation()
        self._bos_id = self._resolve(bos, "bos")
        self._eos_id = self._resolve(eos, "eos")
        self._pad_id = self._eos_id if pad is None else self._resolve(pad, "pad")
        self._mask_id = self._find_mask() if mask is None else self._resolve(mask, "mask")
        # Sequences are read as Hugging Face reads them for the model: GPT-2 adds no bos
        # (its add_bos_token is false), BERT starts each with [CLS]; generation and
        # classification must see the same ids to match it. None: as the tokenizer's
        # post-processor does (a tokenizer.json records it, so a checkpoint keeps it).
        self.prepend_bos = self._post_processor_prepends_bos() if prepend_bos is None \
            else bool(prepend_bos)
        specials = json.dumps({key: self.specials[key] for key in SPECIALS}, sort_keys=True)
        self.fingerprint = hashlib.sha256(
            (backend.to_str() + specials).encode("utf-8")).hexdigest()[:16]
        # An instruct model's way of laying out a conversation (data/chat.py), and the
        # tokens besides eos that end what it generates (a generation_config.json's
        # eos_token_id list: Llama 3's <|eot_id|>, Qwen2's <|im_end|>).
        self.chat_template: ChatTemplate | None = None
        self.stop_ids: tuple[int, ...] = ()

    def with_chat(self, template: "ChatTemplate | None",
                  stop_ids: Sequence[int] = ()) -> HFTokenizer:
        """A copy of this tokenizer with a chat template and end tokens; each stop id must
        be one of the vocabulary's."""
        tokenizer = copy.copy(self)
        tokenizer.chat_template = template
        tokenizer.stop_ids = tuple(sorted({self._resolve(token, "stop") for token in stop_ids}
                                          - {self._eos_id}))
        return tokenizer

    @classmethod
    def from_file(cls, path: Path | str, *, bos: Special, eos: Special,
                  pad: Special | None = None, mask: Special | None = None,
                  prepend_bos: bool | None = None) -> HFTokenizer:
        """A tokenizer.json; pad None means eos (GPT-2 has no pad token of its own), mask
        None its special [MASK] (or <mask>) token if it has one, prepend_bos None what
        its post-processor does."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"{path}: no such tokenizer file")
        library = _tokenizers()
        try:
            backend = library.Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the Rust side raises plain Exception
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({error})") from None
        return cls(backend, path, bos=bos, eos=eos, pad=pad, mask=mask,
                   prepend_bos=prepend_bos)

    @classmethod
    def from_byte_level_bpe(cls, vocab_path: Path | str, merges_path: Path | str, *,
                            bos: str, eos: str, pad: str | None = None,
                            add_prefix_space: bool = False, mask: str | None = None,
                            unk: str | None = None,
                            added: dict[str, int] | None = None) -> HFTokenizer:
        """GPT-2's vocab.json + merges.txt: byte-level pre-tokenization (the GPT-2 split
        pattern, every byte mapped to a printable character), BPE without word affixes,
        the byte-level decoder; the special tokens, which must be in the vocabulary, are
        matched whole in the input, as transformers.GPT2TokenizerFast does. RoBERTa's
        adds a mask token, which takes the space before it (lstrip, as
        RobertaTokenizerFast's), and an unknown one. added: added_tokens.json's tokens
        and ids (CodeGen's runs of spaces and tabs), matched whole before BPE as
        transformers matches them."""
        vocab_path, merges_path = Path(vocab_path), Path(merges_path)
        for file in (vocab_path, merges_path):
            if not file.is_file():
                raise TokenizerError(f"{file}: no such file")
        library = _tokenizers()
        try:
            bpe = library.models.BPE.from_file(str(vocab_path), str(merges_path),
                                               dropout=None, continuing_subword_prefix="",
                                               end_of_word_suffix="", fuse_unk=False,
                                               unk_token=unk)
        except Exception as error:  # noqa: BLE001 - the Rust side raises plain Exception
            raise TokenizerError(f"{vocab_path} + {merges_path.name}: not a readable BPE "
                                 f"vocabulary ({error})") from None
        backend = library.Tokenizer(bpe)
        backend.pre_tokenizer = library.pre_tokenizers.ByteLevel(
            add_prefix_space=add_prefix_space)
        backend.decoder = library.decoders.ByteLevel()
        backend.post_processor = library.processors.ByteLevel(trim_offsets=False)
        tokens = dict.fromkeys(t for t in (bos, eos, pad, mask, unk) if t is not None)
        for token in tokens:     # (each once)
            if backend.token_to_id(token) is None:
                raise TokenizerError(f"{vocab_path}: special token {token!r} is not in the "
                                     f"vocabulary")
        backend.add_special_tokens([library.AddedToken(t, special=True, normalized=False,
                                                       lstrip=t == mask)
                                    for t in tokens])
        _add_tokens_at(backend, added or {}, vocab_path.parent / ADDED_TOKENS_JSON)
        return cls(backend, vocab_path, bos=bos, eos=eos, pad=pad, mask=mask)

    @classmethod
    def from_wordpiece(cls, vocab_path: Path | str, *, lowercase: bool = True,
                       strip_accents: bool | None = None, chinese_chars: bool = True,
                       unk: str = "[UNK]", bos: str = "[CLS]", eos: str = "[SEP]",
                       pad: str = "[PAD]", mask: str | None = "[MASK]") -> HFTokenizer:
        """BERT's vocab.txt (one token a line, the line number its id), assembled as
        transformers.BertTokenizerFast assembles it: the BERT normalizer (control
        characters removed, whitespace unified, CJK characters split apart, lowercased if
        `lowercase`, accents stripped if `strip_accents`, None meaning as `lowercase`),
        the BERT pre-tokenizer (whitespace and punctuation), WordPiece with "##"
        continuations and `unk` for what it cannot spell, the WordPiece decoder, and the
        [CLS] A [SEP] / [CLS] A [SEP] B [SEP] template (used only by add_special_tokens
        callers of the backend; encode() adds nothing). The special tokens, which must be
        in the vocabulary, are matched whole in the input, before normalization."""
        vocab_path = Path(vocab_path)
        if not vocab_path.is_file():
            raise TokenizerError(f"{vocab_path}: no such file")
        try:
            lines = vocab_path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError) as error:
            raise TokenizerError(f"{vocab_path}: unreadable ({error})") from None
        vocab = {line.rstrip("\n"): index for index, line in enumerate(lines)}
        tokens = dict.fromkeys(t for t in (unk, bos, eos, pad, mask) if t is not None)
        for token in tokens:
            if token not in vocab:
                raise TokenizerError(f"{vocab_path}: special token {token!r} is not in the "
                                     f"vocabulary")
        library = _tokenizers()
        backend = library.Tokenizer(library.models.WordPiece(
            vocab, unk_token=unk, continuing_subword_prefix="##"))
        backend.normalizer = library.normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=chinese_chars, strip_accents=strip_accents,
            lowercase=lowercase)
        backend.pre_tokenizer = library.pre_tokenizers.BertPreTokenizer()
        backend.decoder = library.decoders.WordPiece(prefix="##")
        backend.post_processor = library.processors.TemplateProcessing(
            single=f"{bos}:0 $A:0 {eos}:0", pair=f"{bos}:0 $A:0 {eos}:0 $B:1 {eos}:1",
            special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])])
        backend.add_special_tokens([library.AddedToken(t, special=True, normalized=False)
                                    for t in tokens])
        return cls(backend, vocab_path, bos=bos, eos=eos, pad=pad, mask=mask)

    @classmethod
    def from_sentencepiece(cls, tokenizer: "Tokenizer") -> HFTokenizer:
        """One of our SentencePiece models in the tokenizer.json layout of Llama 2's, which
        has the same settings (BPE with byte fallback, no normalization, every space
        kept): a space becomes "▁" after one is put first, BPE runs over the whole text
        with the model's merges (each piece's splits into two pieces of the vocabulary,
        ranked by the piece's id as SentencePiece ranks its merges) and falls back to
        bytes, and every sequence starts with bos (models trained here read [bos] + ids).
        The ids are SentencePiece's (tested on the corpus); refused for other kinds."""
        processor = tokenizer.processor
        _check_llama_like(tokenizer)
        vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
        normal = [piece for piece, i in vocab.items() if not (
            processor.is_control(i) or processor.is_unknown(i) or processor.is_byte(i))]
        merges = sorted((vocab[piece], len(piece[:cut]), vocab[piece[:cut]], vocab[piece[cut:]],
                         piece[:cut], piece[cut:])
                        for piece in normal for cut in range(1, len(piece))
                        if piece[:cut] in vocab and piece[cut:] in vocab)
        library = _tokenizers()
        unk = processor.id_to_piece(processor.unk_id())
        backend = library.Tokenizer(library.models.BPE(
            vocab, [(left, right) for *_, left, right in merges], unk_token=unk,
            byte_fallback=True, fuse_unk=True))
        backend.normalizer = library.normalizers.Sequence([
            library.normalizers.Prepend(WORD_START), library.normalizers.Replace(" ", WORD_START)])
        backend.decoder = library.decoders.Sequence([
            library.decoders.Replace(WORD_START, " "), library.decoders.ByteFallback(),
            library.decoders.Fuse(), library.decoders.Strip(" ", 1, 0)])
        bos = processor.id_to_piece(tokenizer.bos_id)
        backend.post_processor = library.processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.bos_id)])
        backend.add_special_tokens([library.AddedToken(processor.id_to_piece(i), special=True,
                                                       normalized=False)
                                    for i in range(len(vocab))
                                    if processor.is_control(i) or processor.is_unknown(i)])
        return cls(backend, tokenizer.path, bos=tokenizer.bos_id, eos=tokenizer.eos_id,
                   pad=tokenizer.pad_id)

    def with_bert_template(self) -> HFTokenizer:
        """A copy of this tokenizer with BERT's post-processor, [CLS] A [SEP] / [CLS] A
        [SEP] B [SEP] (bos as [CLS], eos as [SEP]), so that its tokenizer.json says
        sequences start with [CLS] and end with [SEP], as an encoder-only model reads them
        (this one is left as it is)."""
        cls, sep = self.piece(self.bos_id), self.piece(self.eos_id)
        return self._with_template(f"{cls}:0 $A:0 {sep}:0",
                                   f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1")

    def with_roberta_template(self) -> HFTokenizer:
        """The same with RoBERTa's, <s> A </s> / <s> A </s> </s> B </s>, one segment."""
        cls, sep = self.piece(self.bos_id), self.piece(self.eos_id)
        return self._with_template(f"{cls} $A {sep}", f"{cls} $A {sep} {sep} $B {sep}")

    def _with_template(self, single: str, pair: str) -> HFTokenizer:
        library = _tokenizers()
        cls, sep = self.piece(self.bos_id), self.piece(self.eos_id)
        backend = library.Tokenizer.from_str(self.backend.to_str())
        backend.post_processor = library.processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(cls, self.bos_id), (sep, self.eos_id)])
        return HFTokenizer(backend, self.path, bos=self.bos_id, eos=self.eos_id,
                           pad=self.pad_id, mask=self.mask_id).with_chat(self.chat_template,
                                                                         self.stop_ids)

    def with_mask(self, token: str | None) -> HFTokenizer:
        """This tokenizer with `token` as its mask token, if the vocabulary has it
        (tokenizer_config.json's mask_token: our exports name <unk>), else itself."""
        token_id = None if token is None else self.backend.token_to_id(token)
        if token_id is None or token_id == self._mask_id:
            return self
        return HFTokenizer(self.backend, self.path, bos=self.bos_id, eos=self.eos_id,
                           pad=self.pad_id, mask=token_id, prepend_bos=self.prepend_bos
                           ).with_chat(self.chat_template, self.stop_ids)

    def _find_mask(self) -> int | None:
        """The id of the special token named [MASK] (or <mask>), if the tokenizer has one."""
        names = {token.content: token_id for token_id, token
                 in self.backend.get_added_tokens_decoder().items() if token.special}
        return next((names[name] for name in MASK_TOKENS if name in names), None)

    def _post_processor_prepends_bos(self) -> bool:
        """Whether the tokenizer's post-processor starts a sequence with bos."""
        try:
            ids = self.backend.encode("", add_special_tokens=True).ids
        except Exception:  # noqa: BLE001 - the Rust side raises plain Exception
            return False
        return bool(ids) and ids[0] == self._bos_id

    def _resolve(self, special: Special, role: str) -> int:
        if isinstance(special, str):
            token_id = self.backend.token_to_id(special)
            if token_id is None:
                raise TokenizerError(f"{self.path}: {role} token {special!r} is not in the "
                                     f"vocabulary")
            return token_id
        if isinstance(special, bool) or not isinstance(special, int) \
                or not 0 <= special < self.vocab_size:
            raise TokenizerError(f"{self.path}: {role}_id={special!r} is not an id of the "
                                 f"vocabulary (0 to {self.vocab_size - 1})")
        return special

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def mask_id(self) -> int | None:
        """The mask token of masked-LM training ([MASK] for BERT); None: none."""
        return self._mask_id

    @cached_property
    def unk_id(self) -> int | None:
        """The token for what the vocabulary cannot spell ([UNK] for BERT, <unk> for
        XLM-R's unigram model); None: none (byte-level BPE spells everything)."""
        token = getattr(self.backend.model, "unk_token", None)
        if token is not None:
            return self.backend.token_to_id(token)
        if type(self.backend.model).__name__ == "Unigram":   # which keeps an id, unexposed
            unk = json.loads(self.backend.to_str())["model"].get("unk_id")
            return unk if isinstance(unk, int) else None
        return None

    @property
    def special_ids(self) -> list[int]:
        """The ids of the tokens the vocabulary marks special ([CLS], [SEP], [PAD],
        [MASK], [UNK] in BERT's; <s>, </s>, <pad>, <mask>, <unk> in RoBERTa's)."""
        return sorted(token_id for token_id, token
                      in self.backend.get_added_tokens_decoder().items() if token.special)

    @property
    def specials(self) -> dict[str, int]:
        """{"bos_id", "eos_id", "pad_id"} and "mask_id" if it has one: what a checkpoint
        records beside the file (a mask token of another name than [MASK] or <mask>,
        our exports' <unk>, is found by this record)."""
        mask = {} if self._mask_id is None else {"mask_id": self._mask_id}
        return {"bos_id": self._bos_id, "eos_id": self._eos_id, "pad_id": self._pad_id, **mask}

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> ids, without specials (no post-processor template: no [CLS]/[SEP])."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text: stops at the first eos; pad and bos are skipped.

        Where eos is also bos or pad (GPT-2: one token for all three), its occurrences
        before the first other token are taken as bos or left padding, and the first
        one after a real token ends the text."""
        kept: list[int] = []
        for token in map(int, ids):
            if token == self._eos_id and (kept or token not in (self._bos_id, self._pad_id)):
                break
            if token not in (self._bos_id, self._pad_id):
                kept.append(token)
        return self.backend.decode(kept, skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        """The vocabulary's string for one id, for display."""
        return self.backend.id_to_token(int(token_id)) or f"<{int(token_id)}>"

    def save(self, path: Path | str) -> Path:
        """Write the tokenizer as one tokenizer.json, atomically (special ids are not in
        it: the caller records them)."""
        with atomic.atomic_file(path) as temporary:
            self.backend.save(str(temporary))
        return Path(path)


def _add_tokens_at(backend, added: dict[str, int], source: Path) -> None:
    """Each of `added`'s tokens matched whole in the input at the id it names: those the
    vocabulary lacks take the next ids, in the order of their ids, which must be the
    ones named (`source`: the file that names them, for the error)."""
    library = _tokenizers()
    for token, wanted in sorted(added.items(), key=lambda item: item[1]):
        if not isinstance(token, str) or isinstance(wanted, bool) or not isinstance(wanted, int):
            raise TokenizerError(f"{source}: expected token -> id, got {token!r}: {wanted!r}")
        if backend.token_to_id(token) is None:
            backend.add_tokens([library.AddedToken(token, normalized=False)])
        if backend.token_to_id(token) != wanted:
            raise TokenizerError(f"{source}: {token!r} is named id {wanted}, but the "
                                 f"vocabulary gives it {backend.token_to_id(token)}")
