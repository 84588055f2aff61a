"""Generation kept to a grammar (json_grammar.py): before each token is chosen, the
tokens whose bytes the grammar cannot read next get -inf, so greedy search and sampling
(top-k, top-p and min-p included) choose among the others exactly as they would among
all; an end token is allowed once the text is whole, and a row whose text has ended
(its root value closed) finishes without one.

Finding the allowed tokens walks a trie of the vocabulary's bytes from the state, and
prunes a branch at the first byte the grammar refuses; a state's mask is cached, and
inside a string, where most tokens are allowed (and leave the state as it is, or count
their characters against a maxLength), only the tokens holding a quote, a backslash, a
control byte or part of a UTF-8 character are walked; the others are allowed by their
count of characters. In a string whose characters are counted (a pattern's, a
maxLength's), each count is a state of its own: there each token's need is found once
per set of the rule's places and compared with the room left (string_masks.py). In free
text up to a marker (a model's reasoning, up to </think>), only the tokens holding the
marker's first byte are walked. After a newline each count of indentation is a state
too: its mask is the one at no indentation less the tokens that lead with more spaces or
tabs than may still come. In a literal (a key, an enum's value), a walk follows the one
byte it expects rather than trying each child of a trie node.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cached_property
from typing import Mapping, Sequence

import torch
from torch import Tensor

from transduce.decode import json_grammar
from transduce.decode.checked_values import CheckedString
from transduce.decode.json_grammar import Root, Stack, State, String, TextUntil
from transduce.decode.pattern_table import PlainTokens
from transduce.decode.string_masks import CountedStrings

# Masks kept per grammar (each a bool per token), and transitions kept per grammar.
CACHED_MASKS = 128
CACHED_STEPS = 200_000
# Bytes a string's body does not take as they are.
STRING_SPECIAL = frozenset(b'"\\') | frozenset(range(0x20))

Trie = dict          # byte -> Trie, and None -> the ids that end there
UNKNOWN = object()   # not yet asked
# A trie node of more children asks whether the state expects only a few bytes; below,
# trying each child costs less than asking.
FEW_BRANCHES = 8


class Vocabulary:
    """A tokenizer's tokens as bytes (token_bytes.py), arranged for masks: a trie of
    them all, a trie of those a string's body cannot take as they are (a quote, a
    backslash, a control byte, part of a UTF-8 character), and the characters of those
    it can (0: a token it cannot), and the spaces and tabs each begins with (indentation
    reads them)."""

    def __init__(self, pieces: Sequence[bytes | None], end_ids: Sequence[int],
                 device: torch.device | str = "cpu", specials: Mapping[str, int] = {}):
        self.size, self.end_ids = len(pieces), [i for i in end_ids if i < len(pieces)]
        self.specials = {name: token for name, token in specials.items() if token < self.size}
        self.trie, self.special_trie = {}, {}
        plain_chars = torch.zeros(self.size, dtype=torch.int32)
        leading_blanks = torch.zeros(self.size, dtype=torch.int32)
        for token, piece in enumerate(pieces):
            if not piece:
                continue
            leading_blanks[token] = len(piece) - len(piece.lstrip(b" \t"))
            _insert(self.trie, piece, token)
            text = _whole_utf8(piece)
            if STRING_SPECIAL.isdisjoint(piece) and text is not None:
                plain_chars[token] = len(text)
            else:
                _insert(self.special_trie, piece, token)
        self.pieces, self.plain_chars = list(pieces), plain_chars.to(device)
        self.leading_blanks = leading_blanks.to(device)
        self.plain = self.plain_chars > 0
        self.single_bytes = frozenset(piece[0] for piece in pieces if piece and len(piece) == 1)
        self._split: dict[int, tuple[Tensor, Trie]] = {}

    @cached_property
    def plain_tokens(self) -> PlainTokens:
        """The plain tokens' characters, position by position: a pattern's table reads them."""
        return PlainTokens({token: self.pieces[token].decode("utf-8")
                            for token in self.plain.nonzero().flatten().tolist()})

    @cached_property
    def plain_trie(self) -> Trie:
        """A trie of the plain tokens' characters (code points): a pattern reads them."""
        trie: Trie = {}
        for token in self.plain.nonzero().flatten().tolist():
            node = trie
            for char in self.pieces[token].decode("utf-8"):
                node = node.setdefault(ord(char), {})
            node.setdefault(None, []).append(token)
        return trie

    def split_by(self, byte: int) -> tuple[Tensor, Trie]:
        """(the mask of the tokens without `byte`, a trie of those with it): free text
        up to a marker takes the first as they are."""
        if byte not in self._split:
            trie: Trie = {}
            for token, piece in enumerate(self.pieces):
                if piece and byte in piece:
                    _insert(trie, piece, token)
            without = torch.tensor([bool(piece) and byte not in piece for piece in self.pieces],
                                   device=self.plain.device)
            self._split[byte] = without, trie
        return self._split[byte]


def _whole_utf8(piece: bytes) -> str | None:
    """A token's text where its bytes are whole UTF-8 characters (a string's body reads
    them and is where it was; a token of part of one leaves it inside a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _insert(trie: Trie, piece: bytes, token: int) -> None:
    for byte in piece:
        trie = trie.setdefault(byte, {})
    trie.setdefault(None, []).append(token)


class TokenGrammar:
    """One grammar over one vocabulary: the tokens allowed in a state, and the state after
    a token."""

    def __init__(self, root: Root, vocabulary: Vocabulary):
        self.root, self.vocabulary = root, vocabulary
        named = json_grammar.specials(root)
        # the special tokens the grammar names that the vocabulary has: id -> symbol
        self.symbols = {vocabulary.specials[name]: json_grammar.special_symbol(name)
                        for name in named if name in vocabulary.specials}
        self._masks: OrderedDict[State, Tensor] = OrderedDict()
        self._steps: dict[tuple[State, int], State] = {}
        self._expected: dict[State, frozenset[int] | None] = {}
        self._strings = CountedStrings(vocabulary)

    def start(self) -> "GrammarRow":
        return GrammarRow(self, json_grammar.start(self.root))

    def unwritable(self) -> bytes:
        """The bytes the grammar may need (json_grammar.needed_bytes) that no token of
        the vocabulary writes alone: a text could meet a state no token goes on from."""
        needed = json_grammar.needed_bytes(self.root)
        return bytes(sorted(needed - self.vocabulary.single_bytes))

    def after(self, state: State, token: int) -> State:
        """The state after `token` (empty: the grammar refuses its bytes)."""
        piece = (self.symbols[token],) if token in self.symbols \
            else self.vocabulary.pieces[token]
        if not piece:
            return frozenset()
        for byte in piece:
            state = self._step(state, byte)
            if not state:
                break
        return state

    def allowed(self, state: State) -> Tensor:
        """(V,) bool: the tokens that may come next in `state` (the end tokens where the
        text is whole, or where nothing else can come, so that a row never has none)."""
        mask = self._masks.get(state)
        if mask is not None:
            self._masks.move_to_end(state)
            return mask
        indented = json_grammar.indentation(state)
        if indented is not None:
            return self._indented(*indented)
        vocabulary = self.vocabulary
        trie, mask = self._unwalked(state)
        mask[self._walk(trie, state)] = True
        for token, symbol in self.symbols.items():
            if self._step(state, symbol):
                mask[token] = True
        if json_grammar.complete(state) or not _any(mask):
            mask[vocabulary.end_ids] = True
        if trie:     # (a mask found without a walk, from a kept table, would evict one)
            self._masks[state] = mask
            if len(self._masks) > CACHED_MASKS:
                self._masks.popitem(last=False)
        return mask

    def _indented(self, base: State, room: int) -> Tensor:
        """The mask of a state `room` spaces or tabs short of the most indentation: the
        mask at no indentation (`base`, kept) less the tokens that lead with more. Not
        kept itself: one comparison, where each indentation kept would evict a walk."""
        base_mask, leads = self.allowed(base), self.vocabulary.leading_blanks
        if base_mask.device.type == "cpu":
            mask = torch.from_numpy(base_mask.numpy() & (leads.numpy() <= room))
        else:
            mask = base_mask & (leads <= room)
        if not _any(mask):
            mask[self.vocabulary.end_ids] = True
        return mask

    def _unwalked(self, state: State) -> tuple[Trie, Tensor]:
        """(a trie of the tokens to walk from `state`, the mask of those allowed without
        a walk): in a string whose characters are counted, the tokens whose needs fit
        (string_masks.py); in free text, the tokens without the marker's first byte; in
        a string's body, the plain ones its room takes; elsewhere none."""
        vocabulary = self.vocabulary
        counted = self._strings.unwalked(state, self._step)
        if counted is not None:
            return counted
        marker = _free_text(state)
        if marker is not None:
            without, trie = vocabulary.split_by(marker)
            return trie, without.clone()
        rooms = [_string_room(stack) for stack in state]
        if None in rooms:
            return vocabulary.trie, torch.zeros_like(vocabulary.plain)
        room = max(rooms)
        plain = vocabulary.plain if room == float("inf") \
            else vocabulary.plain & (vocabulary.plain_chars <= room)
        return vocabulary.special_trie, plain.clone()

    def _walk(self, trie: Trie, state: State) -> list[int]:
        """The ids of `trie`'s tokens whose bytes the grammar reads from `state`."""
        found: list[int] = []
        pending = [(trie, state)]
        while pending:
            node, at = pending.pop()
            branches = node.items()
            if len(node) > FEW_BRANCHES:        # a literal's next byte: one of many children
                expected = self._next_bytes(at)
                if expected is not None:
                    branches = [(byte, node[byte]) for byte in expected if byte in node]
            for byte, child in branches:
                if byte is None:
                    continue
                following = self._step(at, byte)
                if following:
                    found.extend(child.get(None, ()))
                    pending.append((child, following))
        return found

    def _next_bytes(self, state: State) -> frozenset[int] | None:
        """json_grammar.next_bytes, kept per state (a walk asks at every trie node)."""
        expected = self._expected.get(state, UNKNOWN)
        if expected is UNKNOWN:
            if len(self._expected) > CACHED_STEPS:
                self._expected.clear()
            expected = self._expected[state] = json_grammar.next_bytes(state)
        return expected

    def _step(self, state: State, byte: int) -> State:
        key = (state, byte)
        following = self._steps.get(key)
        if following is None:
            if len(self._steps) > CACHED_STEPS:
                self._steps.clear()
            following = self._steps[key] = json_grammar.advance(state, (byte,))
        return following


def _any(mask: Tensor) -> bool:
    """mask.any(), through NumPy on a CPU (1 us against PyTorch's 15 at 32,000 tokens)."""
    return bool(mask.numpy().any()) if mask.device.type == "cpu" else bool(mask.any())


def _string_room(stack: Stack) -> float | None:
    """The characters of plain text (no quote, backslash or control byte; whole UTF-8
    characters) a stack's string may still take; None where it is in no string's body
    or its string keeps a pattern."""
    node, local = stack[-1]
    if type(node) is String:
        return float("inf") if local == String.BODY else None
    return node.room(local) if isinstance(node, CheckedString) else None


def _free_text(state: State) -> int | None:
    """The first byte of the marker that ends free text (TextUntil), where the state is
    in free text and none of the marker read yet: tokens without that byte are read
    there and leave it as it is. None elsewhere."""
    firsts = {node.end[0] if isinstance(node, TextUntil) and matched == 0 else None
              for node, matched in (stack[-1] for stack in state)}
    return firsts.pop() if len(firsts) == 1 else None


class GrammarRow:
    """One row's place in its grammar, moved on by each token it generates."""

    def __init__(self, grammar: TokenGrammar, state: State):
        self.grammar, self.state = grammar, state

    def allowed(self) -> Tensor:
        return self.grammar.allowed(self.state)

    def add(self, token: int) -> None:
        self.state = self.grammar.after(self.state, token)

    @property
    def ended(self) -> bool:
        """The text is whole and nothing may follow it."""
        return json_grammar.ended(self.state)


def constrained(logits: Tensor, grammars: Sequence[GrammarRow | None]) -> Tensor:
    """logits (R, V) with -inf where row r's grammar (None: none) refuses a token."""
    rows = [index for index, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return logits
    allowed = torch.stack([grammars[index].allowed() for index in rows])     # (R', V)
    vocab = allowed.shape[1]
    refused = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    refused[:, :vocab] = ~allowed
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(refused, float("-inf"))
    return logits
