"""Masks inside a string whose characters are counted (a pattern's, a maxLength's).

Each count is a state of its own, so a mask found per state would walk the vocabulary
again at every count of every string a model writes, and a schema of a few such fields
has more counts than a grammar keeps masks. Past the minLength, what a token needs is
the same at every count: its characters and the fewest more to an end must fit in the
room left. So each token's need is found once per set of the rule's places (for a token
that closes the string, per place in the JSON around it too), and a count's mask is
the tokens whose need is within its room: the plain tokens' from a pattern's table
(pattern_table.py), or their characters where no pattern is kept; the others' (a quote,
a backslash, a control byte, part of a UTF-8 character) from one walk of their trie.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cached_property
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from transduce.decode.checked_values import CheckedString
from transduce.decode.json_grammar import Stack, State
from transduce.decode.pattern_table import NEVER, PatternTable

if TYPE_CHECKING:
    from transduce.decode.constrained import Trie, Vocabulary

# Needs kept per grammar, each of two kinds: at most 128 (V,) tables, as many as masks.
CACHED_NEEDS = 64


Step = Callable[[State, int], State]     # a grammar's (cached) step of a state by a byte


class CountedStrings:
    """One grammar's needs of the tokens inside its counted strings."""

    def __init__(self, vocabulary: "Vocabulary"):
        self.vocabulary = vocabulary
        self._plain_by_places: OrderedDict[tuple, Tensor] = OrderedDict()
        self._every: OrderedDict[tuple, Tensor] = OrderedDict()
        self._tables: dict = {}

    def unwalked(self, state: State, step: Step) -> "tuple[Trie, Tensor] | None":
        """In a counted string's body past its minLength: (a trie of the tokens still
        to walk, the mask of those allowed without a walk), where the second is every
        plain token that fits, and the special tokens' too (an empty trie) from the
        first count on; `step` the grammar's (passed, not kept: a grammar keeping this
        would otherwise be a cycle, its caches left to the garbage collector). None
        elsewhere."""
        if len(state) != 1:
            return None
        stack = next(iter(state))
        node, local = stack[-1]
        if not isinstance(node, CheckedString) or local[0] != CheckedString.BODY:
            return None
        rule, (places, count) = node.rule, local[2]
        if count < rule.min_length or (rule.pattern is None and rule.max_length is None):
            return None
        if rule.max_length is None:
            return self.vocabulary.special_trie, at_most(self._plain(node, places), NEVER - 1)
        room = rule.max_length - count
        if count == 0:                                 # (^ holds there alone)
            return self.vocabulary.special_trie, at_most(self._plain(node, places), room)
        below = stack[:-1]
        needs = self._kept(self._every, (below, node, places), lambda: torch.minimum(
            self._plain(node, places), self._special_needs(below, node, places, step)))
        return {}, at_most(needs, room)

    def _plain(self, node: CheckedString, places: int) -> Tensor:
        """(V,) each plain token's need from `places` (NEVER for the others)."""
        if node.rule.pattern is None:
            return self._plain_characters
        return self._kept(self._plain_by_places, (node, places),
                          lambda: self._plain_needs(node, places))

    @cached_property
    def _plain_characters(self) -> Tensor:
        """Where no pattern is kept, a plain token needs its characters."""
        vocabulary = self.vocabulary
        return torch.where(vocabulary.plain, vocabulary.plain_chars, NEVER)

    @staticmethod
    def _kept(cache: OrderedDict, key: tuple, find: Callable[[], Tensor]) -> Tensor:
        needs = cache.get(key)
        if needs is None:
            needs = cache[key] = find()
            if len(cache) > CACHED_NEEDS:
                cache.popitem(last=False)
        return needs

    def _plain_needs(self, node: CheckedString, places: int) -> Tensor:
        """(V,) each plain token's characters plus the fewest more to an end, read from
        `places` whatever the lengths (NEVER: it cannot be read there): through the
        pattern's table (pattern_table.py), or, where that would be too large, by a walk
        of the plain tokens' trie."""
        table = self._tables.get(node.rule)
        if table is None:
            table = self._tables[node.rule] = PatternTable(node.rule,
                                                           self.vocabulary.plain_tokens)
        needs = table.needs(places, self.vocabulary.size, self.vocabulary.plain.device)
        return needs if needs is not None else self._plain_needs_by_walk(node, places)

    def _plain_needs_by_walk(self, node: CheckedString, places: int) -> Tensor:
        """_plain_needs by a walk of the plain tokens' trie."""
        rule, ids, needs = node.rule, [], []
        pending = [(self.vocabulary.plain_trie, places, 1)]
        while pending:
            trie, at, chars = pending.pop()
            for char, child in trie.items():
                if char is None:
                    continue
                after = rule.step(at, char)
                distance = rule.distance(after)
                if distance == float("inf"):
                    continue
                found = child.get(None, ())
                ids.extend(found)
                needs.extend([chars + int(distance)] * len(found))
                pending.append((child, after, chars + 1))
        return self._table(ids, needs)

    def _special_needs(self, below: Stack, node: CheckedString, places: int,
                       step: Step) -> Tensor:
        """(V,) each special token's least room (the maxLength less the count) at which
        it is read from `places` in the string `node` over the frames `below` (NEVER:
        at none): the walk from the first count its rule tells apart from those beyond
        (the minLength, or 1), at the most room, where a byte in the string is read
        where the characters since and the fewest more to an end (CheckedString.finish)
        fit; a byte past the closing quote is read at any count."""
        first = max(node.rule.min_length, 1)
        start = frozenset({below + ((node, (CheckedString.BODY, None, (places, first))),)})
        ids, needs = [], []
        pending = [(self.vocabulary.special_trie, start, 0, True)]
        while pending:
            trie, state, need, inside = pending.pop()
            for byte, child in trie.items():
                if byte is None:
                    continue
                following = step(state, byte)
                if not following:
                    continue
                local = _string_local(following, node) if inside else None
                reached = need if local is None else \
                    max(need, local[2][1] - first + int(node.finish(local)))
                found = child.get(None, ())
                ids.extend(found)
                needs.extend([reached] * len(found))
                pending.append((child, following, reached, local is not None))
        return self._table(ids, needs)

    def _table(self, ids: list[int], needs: list[int]) -> Tensor:
        table = torch.full((self.vocabulary.size,), NEVER,
                           dtype=torch.int32, device=self.vocabulary.plain.device)
        table[ids] = torch.tensor(needs, dtype=torch.int32, device=table.device)
        return table


def at_most(needs: Tensor, room: int) -> Tensor:
    """needs <= room, a new (V,) bool: on a CPU through NumPy, whose comparison of a
    vocabulary's needs takes a quarter of PyTorch's time (3 against 12 us at 32,000)."""
    if needs.device.type != "cpu":
        return needs <= room
    return torch.from_numpy(needs.numpy() <= room)


def _string_local(state: State, node: CheckedString) -> tuple | None:
    """The string's local state where `state`, a byte after one in the string `node`,
    is still in it (not past its closing quote), else None."""
    if len(state) != 1:
        return None
    frame = next(iter(state))[-1]
    return frame[1] if frame[0] is node else None
