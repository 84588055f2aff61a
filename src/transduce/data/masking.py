"""BERT's inputs: the special tokens, masked-LM masking, next-sentence pairs, and the
length batching of encoder items.

Special tokens (EncoderSpecials). Our SentencePiece vocabularies have no [CLS], [SEP]
or [MASK] (tokenizer.py fixes pad 0, bos 1, eos 2, unk 3), so the encoder reuses them,
and no vocabulary changes:
    CLS_ID  = BOS_ID (1)   opens every sequence; the pooler reads its state
    SEP_ID  = EOS_ID (2)   closes each sentence
    MASK_ID = UNK_ID (3)   the masked-LM's [MASK]: SentencePiece with byte fallback and
                           full character coverage never produces unk (an unseen
                           character becomes its UTF-8 bytes), so [MASK] never stands
                           for real text.
Ids below NUM_SPECIALS are never chosen for masking, never a random replacement. An
imported checkpoint's tokenizer (BERT's WordPiece, RoBERTa's byte-level BPE) has its
own: bos is [CLS], eos [SEP], its pad and mask tokens, and every special token of the
vocabulary is left alone as those four are here.

Layouts (segments 0 for [CLS] A [SEP], 1 for B [SEP]):
    one sentence (MLM, classification):  [CLS] A [SEP]
    a pair (MLM + NSP):                  [CLS] A [SEP] B [SEP]
A sequence longer than max_len is cropped (a pair: the longer side first, as BERT's
truncate_seq_pair), never dropped.

Masking (Devlin et al. 2019): of each sequence's pieces (specials and padding
excluded), round(15%) but at least one are chosen; of those 80% become [MASK], 10% a
random piece, 10% stay. Labels hold the original piece at chosen positions and IGNORE
elsewhere. The count per sequence is a function of its length alone, so a batch's
number of scored positions is known before masking (the loop normalises by it), and
which positions is a function of a torch.Generator seeded with (seed, epoch, batch),
so a resumed run masks exactly as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TextTokenizer

CLS_ID, SEP_ID, MASK_ID = BOS_ID, EOS_ID, UNK_ID
NUM_SPECIALS = 4          # pad, bos/[CLS], eos/[SEP], unk/[MASK]
IGNORE = -100             # label of a position not scored (torch's cross_entropy default)
MASK_FRACTION = 0.15
MASK_TOKEN_SHARE, RANDOM_TOKEN_SHARE = 0.8, 0.1   # the rest of the chosen stay unchanged


@dataclass(frozen=True)
class EncoderSpecials:
    """The ids an encoder's items are built with, and those masking leaves alone."""

    cls_id: int
    sep_id: int
    pad_id: int
    mask_id: int | None        # None: the vocabulary has none (it can classify, not mask)
    special: tuple[int, ...]   # never chosen for masking, never a random replacement

    @classmethod
    def of(cls, tokenizer: TextTokenizer) -> "EncoderSpecials":
        """A tokenizer's: ours (SentencePiece) as the module says, an imported one's from
        its vocabulary (bos as [CLS], eos as [SEP], its [MASK] or <mask>, and every
        token it marks special)."""
        if not isinstance(tokenizer, HFTokenizer):
            return SENTENCEPIECE
        mask = tokenizer.mask_id
        named = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id, mask}
        return cls(tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, mask,
                   tuple(sorted((set(tokenizer.special_ids) | named) - {None})))

    def not_special(self, ids: Tensor, vocab_size: int) -> Tensor:
        """(...) ids -> (...) bool: True where an id is no special token."""
        return ~_special_table(self.special, vocab_size)[ids]

    def replacements(self, vocab_size: int) -> Tensor:
        """(R,) the ids a chosen piece may be replaced by: every id but the specials."""
        return _replacements(self.special, vocab_size)


@lru_cache(maxsize=8)
def _special_table(special: tuple[int, ...], vocab_size: int) -> Tensor:
    """(V,) bool: True at the special ids."""
    table = torch.zeros(vocab_size, dtype=torch.bool)
    table[list(special)] = True
    return table


@lru_cache(maxsize=8)
def _replacements(special: tuple[int, ...], vocab_size: int) -> Tensor:
    return torch.nonzero(~_special_table(special, vocab_size)).flatten()


SENTENCEPIECE = EncoderSpecials(CLS_ID, SEP_ID, PAD_ID, MASK_ID, tuple(range(NUM_SPECIALS)))


def masked_count(pieces: np.ndarray | Tensor) -> np.ndarray | Tensor:
    """How many of a sequence's `pieces` (non-special tokens) are chosen: round(15%),
    at least 1 when there is any piece. Works on arrays and tensors alike."""
    rounded = (pieces * MASK_FRACTION + 0.5) // 1
    chosen = np.maximum(rounded, 1) if isinstance(pieces, np.ndarray) else rounded.clamp_min(1)
    return chosen * (pieces > 0)


def generator(*key: int) -> torch.Generator:
    """A CPU generator seeded by a tuple of ints (seed, epoch, batch...), the same on
    every machine and process."""
    seed = int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]).generate_state(1)[0])
    return torch.Generator().manual_seed(seed)


def mask_tokens(ids: Tensor, vocab_size: int, rng: torch.Generator,
                specials: EncoderSpecials = SENTENCEPIECE, *,
                candidate: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """ids (B, T) -> (inputs (B, T), labels (B, T)): masked_count pieces of each row
    chosen uniformly, 80 / 10 / 10 replaced by [MASK] / a random piece / themselves;
    labels the original ids there, IGNORE elsewhere. candidate (B, T): the positions
    that may be chosen, by default those of no special id. The batcher passes the
    positions of the texts' pieces, so that the count is a function of the item's length
    even where a text holds a special token (an imported WordPiece's [UNK])."""
    if specials.mask_id is None:
        raise ValueError("the vocabulary has no mask token ([MASK] or <mask>): it cannot "
                         "train a masked LM")
    if candidate is None:
        candidate = specials.not_special(ids, vocab_size)                     # (B, T)
    count = masked_count(candidate.sum(dim=1))                                # (B,)
    scores = torch.rand(ids.shape, generator=rng)
    scores = scores.masked_fill(~candidate, 2.0)       # non-candidates rank last
    rank = scores.argsort(dim=1).argsort(dim=1)                               # (B, T)
    chosen = rank < count[:, None]
    action = torch.rand(ids.shape, generator=rng)
    replacements = specials.replacements(vocab_size)                          # (R,)
    random_ids = replacements[torch.randint(0, len(replacements), ids.shape, generator=rng)]
    inputs = torch.where(chosen & (action < MASK_TOKEN_SHARE), specials.mask_id, ids)
    use_random = chosen & (action >= MASK_TOKEN_SHARE) & \
        (action < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE)
    inputs = torch.where(use_random, random_ids, inputs)
    labels = torch.where(chosen, ids, IGNORE)
    return inputs, labels


def next_sentence_pairs(num_lines: int, rng: np.random.Generator
                        ) -> tuple[np.ndarray, np.ndarray]:
    """NSP pairs over lines in order: sentence A is line i (i < num_lines - 1); half the
    pairs (Bernoulli 0.5) take B = line i + 1 (label 0, "B follows A"), the others a
    uniformly random line that is neither i + 1 nor i (label 1). -> (partners (N-1,),
    labels (N-1,))."""
    if num_lines < 3:
        raise ValueError(f"next-sentence pairs need at least 3 lines, got {num_lines}")
    first = np.arange(num_lines - 1)
    labels = (rng.random(num_lines - 1) < 0.5).astype(np.int64)
    # A random line other than i and i + 1: draw from num_lines - 2 and skip past both.
    draw = rng.integers(0, num_lines - 2, size=num_lines - 1)
    draw = np.where(draw >= first, draw + 2, draw)
    partners = np.where(labels == 0, first + 1, draw)
    return partners, labels


@dataclass
class EncoderBatch:
    ids: Tensor                   # (B, T) [CLS] A [SEP] (B [SEP]), masked for MLM, right-padded
    segments: Tensor              # (B, T) 0 for A and its markers, 1 for B; 0 on padding
    mlm_labels: Tensor | None     # (B, T) original ids at chosen positions, IGNORE elsewhere
    nsp_labels: Tensor | None     # (B,) 0 "B follows A", 1 random
    labels: Tensor | None         # (B,) class indices (classification), or (B, T) tag
                                  # indices at tagged pieces, IGNORE elsewhere (tagging)
    indices: Tensor               # (B,) the items (lines, pairs) in the dataset
    spans: Tensor | None = None   # (B, 2) an answer's start and end positions (QA windows)

    def to(self, device: torch.device | str) -> "EncoderBatch":
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)
        return EncoderBatch(*(move(t) for t in (self.ids, self.segments, self.mlm_labels,
                                                 self.nsp_labels, self.labels, self.indices,
                                                 self.spans)))


def crop_pair(a: np.ndarray, b: np.ndarray | None, max_len: int, one_segment: bool = False
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """Crop A (and B) so that [CLS] A [SEP] (B [SEP]) fits max_len (one_segment: a pair
    as RoBERTa's, one separator more), each side cut at its end: the shorter side
    keeps up to half the room, A at a tie, as the tokenizers library's "longest_first"
    truncation of a pair (transformers' default)."""
    room = max_len - (2 if b is None else 3 + one_segment)
    if b is None:
        return a[:room], None
    len_a, len_b = len(a), len(b)
    if len_a + len_b > room:   # the shorter (A at a tie) keeps up to half, the other the rest
        if len_a <= len_b:
            len_a = min(len_a, room // 2)
            len_b = room - len_a
        else:
            len_b = min(len_b, room // 2)
            len_a = room - len_b
    return a[:len_a], b[:len_b]


def encoder_item(a: np.ndarray, b: np.ndarray | None, cls_id: int, sep_id: int,
                 one_segment: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (T_a,) and B (T_b,) or None -> the item an encoder reads: ids [CLS] A [SEP]
    (B [SEP]), segments 0 for A and its markers and 1 for B's, and which positions hold
    the texts' pieces (bool), each (T,). A model of one segment type (RoBERTa) reads a
    pair as its tokenizer builds one, <s> A </s></s> B </s>, all in segment 0."""
    parts = [[cls_id], a, [sep_id]]
    if b is not None:
        parts += [[sep_id] * one_segment, b, [sep_id]]
    ids = np.concatenate(parts).astype(np.int64)
    segments = np.zeros(len(ids), dtype=np.int64)
    pieces = np.zeros(len(ids), dtype=bool)
    pieces[1:len(a) + 1] = True
    if b is not None:
        start = len(a) + 2 + one_segment                    # B's first piece
        segments[len(a) + 2:] = 0 if one_segment else 1
        pieces[start:start + len(b)] = True
    return ids, segments, pieces
