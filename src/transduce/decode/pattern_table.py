"""A string pattern's automaton run over every plain token of the vocabulary at once.

A new state of a pattern string needs each plain token's fate from its set of places:
whether its characters can be read, and how many more the string needs to an end. A
walk of the vocabulary's trie asks the pattern one character at a time, in Python, at
each of some 78,000 nodes of a 32,000-token vocabulary. Here the pattern's sets of
places reachable from the state become a table (sets x classes of characters the
pattern tells apart, built a set of places at a time), and every token's characters
step through it together, one NumPy gather per character position. Where the table
would be too large (a pattern whose sets of places multiply), the caller keeps the walk.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from transduce.decode.regex_automaton import StringRule

# The most entries (sets of places x classes of characters) a table may hold.
MAX_TABLE = 1 << 18
NEVER = torch.iinfo(torch.int32).max      # a need where the token cannot be read


class PlainTokens:
    """The plain tokens' characters (code points), longest first, position by position:
    codes[i] (running[i],) int32, the (i + 1)-th character of each token that has one;
    lengths (P,) and ids (P,) in that order. NumPy's, whose small operations cost a
    fifth of PyTorch's: a table's run is one per character position."""

    def __init__(self, texts: dict[int, str]):
        order = sorted(texts, key=lambda token: -len(texts[token]))
        self.ids = np.array(order, dtype=np.int64)
        self.lengths = np.array([len(texts[token]) for token in order], dtype=np.int64)
        longest = int(self.lengths[0]) if order else 0
        self.running = [int((self.lengths > i).sum()) for i in range(longest)]
        self.codes = [np.array([ord(texts[token][i]) for token in order[:running]],
                               dtype=np.int32)
                      for i, running in enumerate(self.running)]


class PatternTable:
    """One rule's table over one vocabulary's plain tokens. Code points between two
    consecutive bounds of the rule's character sets meet the same sets, so one of them
    (the lower bound) stands for its class: classes[i], the class of each plain token's
    (i + 1)-th character (PlainTokens.codes). The sets of places met so far, and for
    each the set each class leads to, grow as states ask from new sets, and are shared
    by all of them."""

    def __init__(self, rule: StringRule, tokens: PlainTokens):
        bounds = {0}
        for moves in rule.moves:
            for charset, _ in moves:
                for low, high in charset.ranges():
                    bounds.update((low, high + 1))
        self.rule, self.tokens = rule, tokens
        self.representatives = sorted(bounds)
        kind = np.int16 if len(bounds) < 1 << 15 else np.int32
        self.classes = [(np.searchsorted(self.representatives, codes, side="right") - 1)
                        .astype(kind) for codes in tokens.codes]
        self.index: dict[int, int] = {}          # a set of places -> its row
        self.sets: list[int] = []
        self.rows: list[list[int]] = []          # per set, the row each class leads to
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self.too_large = False

    def needs(self, places: int, vocabulary_size: int,
              device: torch.device | str = "cpu") -> Tensor | None:
        """(V,) int32: each plain token's characters plus the fewest more to an end,
        read from `places` whatever the lengths (NEVER where it cannot be read there,
        and for every other token); None where the table would pass MAX_TABLE."""
        start = self._grown_from(places)
        if start is None:
            return None
        distance = self._as_arrays()[1][self._read(start)]
        needs = np.where(np.isinf(distance), NEVER,
                         np.minimum(self.tokens.lengths + distance, NEVER)).astype(np.int32)
        out = np.full(vocabulary_size, NEVER, dtype=np.int32)
        out[self.tokens.ids] = needs
        return torch.from_numpy(out).to(device)

    def _read(self, start: int) -> np.ndarray:
        """(P,) the row each plain token's characters lead to from row `start` (any
        hopeless one, where the token met a set from which the string cannot end)."""
        steps, distances = self._as_arrays()
        tokens, width = self.tokens, len(self.representatives)
        hopeless = np.isinf(distances)     # sets from which the string cannot end
        state = np.full(len(tokens.lengths), start, dtype=np.int64)
        alive = None                       # once few tokens can still end: those
        for position, running in enumerate(tokens.running):
            if alive is None:
                read = state[:running]
                read *= width
                read += self.classes[position]
                state[:running] = steps[read]
                if position == 0 and 4 * np.count_nonzero(~hopeless[state]) < running:
                    alive = np.flatnonzero(~hopeless[state])
                continue
            alive = alive[:np.searchsorted(alive, running)]
            if not alive.size:
                break
            after = steps[state[alive] * width + self.classes[position][alive]]
            state[alive] = after
            alive = alive[~hopeless[after]]
        return state

    def _grown_from(self, places: int) -> int | None:
        """The row of `places`, the table grown by every set reachable from it (a row a
        set, StringRule.steps_by_class); None past MAX_TABLE entries, from then on."""
        if self.too_large:
            return None
        if places not in self.index:
            self._add(places)
            while len(self.rows) < len(self.sets):
                self.rows.append([self._add(after) for after in self.rule.steps_by_class(
                    self.sets[len(self.rows)], self.representatives)])
                if len(self.sets) * len(self.representatives) > MAX_TABLE:
                    self.too_large = True
                    return None
            self._arrays = None
        return self.index[places]

    def _add(self, places: int) -> int:
        if places not in self.index:
            self.index[places] = len(self.sets)
            self.sets.append(places)
        return self.index[places]

    def _as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(the rows flattened (S * C,), each set's fewest characters to an end (S,))."""
        if self._arrays is None:
            self._arrays = (np.array(self.rows, dtype=np.int64).reshape(-1),
                            np.array([self.rule.distance(found) for found in self.sets],
                                     dtype=np.float64))
        return self._arrays
