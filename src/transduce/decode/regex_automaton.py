"""A JSON Schema string rule (a `pattern`, an ECMA-262 regular expression, and the
lengths minLength and maxLength) as an automaton over characters, for json_grammar's
checked strings: which characters may come next so that the string can still end an
instance, and whether it may end now.

A pattern matches where it is found anywhere in the string, as JSON Schema says (so it
is read as [\\s\\S]*(pattern)[\\s\\S]*, with ^ and $ holding only at the ends). It is
compiled to a nondeterministic automaton (Thompson's construction); a state is the set
of its places as an int of bits, so that it is small and hashable. Lengths count
characters (code points), as the schema's validators do. Characters that lead nowhere an
instance can end are refused at once, with their lengths counted: a table of, for each
count of characters so far, the places from which an end can still be reached, so that
generation never writes itself into a string it cannot close.

Lookarounds, backreferences, word boundaries and Unicode property classes are no regular
languages or are not read here: a PatternError names them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from typing import Iterator, Sequence

MAX_CHAR = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
# The most places one pattern compiles to, and the most (places x counted lengths) its
# table of live places may hold.
MAX_PLACES = 4_000
MAX_TABLE = 2_000_000
MAX_NESTING = 64          # groups within groups
CACHED_STEPS = 50_000


class PatternError(ValueError):
    """A pattern this automaton does not read; says where in it and why."""


class CharSet:
    """A set of code points as sorted, disjoint, inclusive ranges (never a surrogate: no
    JSON text of UTF-8 writes one alone)."""

    def __init__(self, ranges: list[tuple[int, int]]):
        merged: list[list[int]] = []
        for low, high in sorted(ranges):
            if merged and low <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        cut = []
        for low, high in merged:          # the surrogates taken out
            if low < SURROGATES[0]:
                cut.append((low, min(high, SURROGATES[0] - 1)))
            if high > SURROGATES[1]:
                cut.append((max(low, SURROGATES[1] + 1), high))
        self.starts = tuple(low for low, _ in cut)
        self.ends = tuple(high for _, high in cut)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends))

    def complement(self) -> "CharSet":
        ranges, low = [], 0
        for start, end in self.ranges():
            if start > low:
                ranges.append((low, start - 1))
            low = end + 1
        if low <= MAX_CHAR:
            ranges.append((low, MAX_CHAR))
        return CharSet(ranges)

    def meets(self, low: int, high: int) -> bool:
        """Whether a code point in [low, high] is in the set."""
        at = bisect_right(self.starts, high) - 1
        return at >= 0 and self.ends[at] >= low

    def __bool__(self) -> bool:
        return bool(self.starts)


def chars(*spans: str) -> CharSet:
    """A CharSet from single characters and "a-z" spans."""
    return CharSet([(ord(s[0]), ord(s[-1])) for s in spans])


DIGIT = chars("0-9")
WORD = chars("a-z", "A-Z", "0-9", "_")
SPACE = CharSet([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680),
                 (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
                 (0x3000, 0x3000), (0xFEFF, 0xFEFF)])
ANY = CharSet([(0, MAX_CHAR)])
DOT = CharSet([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]).complement()
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D}

# The parsed pattern: ("chars", CharSet), ("bol",), ("eol",), ("cat", [parts]),
# ("alt", [options]), ("repeat", part, low, high or None)
Tree = tuple


class _Parser:
    """Recursive descent over the pattern's text."""

    def __init__(self, text: str):
        self.text, self.at, self.depth = text, 0, 0

    def fail(self, why: str, back: int = 0) -> PatternError:
        """An error at the cursor, or `back` characters before it."""
        return PatternError(f"{why} at character {self.at - back} of {self.text!r}")

    def peek(self, ahead: int = 0) -> str:
        at = self.at + ahead
        return self.text[at] if at < len(self.text) else ""

    def take(self) -> str:
        char = self.peek()
        self.at += 1
        return char

    def parse(self) -> Tree:
        tree = self.alternation()
        if self.at < len(self.text):
            raise self.fail("an unmatched ')'")
        return tree

    def alternation(self) -> Tree:
        options = [self.sequence()]
        while self.peek() == "|":
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self) -> Tree:
        parts = []
        while self.peek() not in ("", "|", ")"):
            parts.append(self.quantified(self.atom()))
        return ("cat", parts)

    def quantified(self, atom: Tree) -> Tree:
        char = self.peek()
        bounds = self._bounds() if char == "{" else None
        if char in ("*", "+", "?"):
            self.take()
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif bounds is not None:
            low, high = bounds
        else:
            return atom
        if atom[0] in ("bol", "eol"):
            raise self.fail("a quantifier after an anchor")
        if self.peek() == "?":                   # lazy: the same strings
            self.take()
        return ("repeat", atom, low, high)

    def _bounds(self) -> tuple[int, int | None] | None:
        """{n}, {n,} or {n,m} at the cursor (taken), or None: a '{' of itself."""
        end = self.text.find("}", self.at)
        inner = self.text[self.at + 1:end] if end > 0 else ""
        low, comma, high = inner.partition(",")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        self.at = end + 1
        bounds = int(low), (int(high) if high else None if comma else int(low))
        if bounds[1] is not None and bounds[1] < bounds[0]:
            raise self.fail(f"{{{inner}}}: the upper bound is below the lower")
        return bounds

    def atom(self) -> Tree:
        char = self.take()
        if char == "(":
            if self.depth >= MAX_NESTING:
                raise self.fail(f"groups nested deeper than {MAX_NESTING}", back=1)
            if self.peek() == "?":
                self._group_kind()
            self.depth += 1
            tree = self.alternation()
            self.depth -= 1
            if self.take() != ")":
                raise self.fail("an unclosed '('")
            return tree
        if char in ("*", "+", "?"):
            raise self.fail(f"nothing to repeat before {char!r}", back=1)
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            return ("chars", DOT)
        if char == "^":
            return ("bol",)
        if char == "$":
            return ("eol",)
        if char == "\\":
            return ("chars", self.escape())
        return ("chars", CharSet([(ord(char), ord(char))]))

    def _group_kind(self) -> None:
        """After '(?': a non-capturing or named group is read as a group; lookarounds
        are refused."""
        if self.peek(1) == ":":
            self.at += 2
        elif self.peek(1) == "<" and self.peek(2) not in ("=", "!"):
            close = self.text.find(">", self.at)
            if close < 0:
                raise self.fail("an unclosed group name")
            self.at = close + 1
        else:
            raise self.fail("a lookaround, which no automaton of characters can keep")

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        if negated:
            self.take()
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            if not self.peek():
                raise self.fail("an unclosed '['")
            low = self._class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.take()
                high = self._class_atom()
                if isinstance(low, CharSet) or isinstance(high, CharSet):
                    raise self.fail("a range with a class at one end")
                if high < low:
                    raise self.fail("a range out of order")
                ranges.append((low, high))
            elif isinstance(low, CharSet):
                ranges.extend(low.ranges())
            else:
                ranges.append((low, low))
        self.take()
        found = CharSet(ranges)
        return found.complement() if negated else found

    def _class_atom(self) -> int | CharSet:
        char = self.take()
        if char != "\\":
            return ord(char)
        if self.peek() == "b":                   # backspace, within a class
            self.take()
            return 0x08
        found = self.escape()
        return found if len(found.starts) != 1 or found.starts != found.ends \
            else found.starts[0]

    def escape(self) -> CharSet:
        """The characters an escape (after its backslash) stands for."""
        char = self.take()
        if char.lower() in CLASS_ESCAPES:
            found = CLASS_ESCAPES[char.lower()]
            return found.complement() if char.isupper() else found
        if char in CONTROL_ESCAPES:
            return _one(CONTROL_ESCAPES[char])
        if char == "0" and not self.peek().isdigit():
            return _one(0)
        if char in ("x", "u"):
            return _one(self._hex_escape(char))
        if char.isalnum() or not char:
            what = {"b": "a word boundary", "B": "a word boundary",
                    "p": "a Unicode property class", "P": "a Unicode property class",
                    "k": "a backreference"}.get(char, "a backreference" if char.isdigit()
                                                 else f"the escape \\{char}")
            raise self.fail(f"{what}, which is not read here", back=2)
        return _one(ord(char))                   # \. \\ \/ \- ...: the character itself

    def _hex_escape(self, kind: str) -> int:
        if kind == "u" and self.peek() == "{":
            end = self.text.find("}", self.at)
            digits, after = self.text[self.at + 1:end], end + 1
        else:
            width = 2 if kind == "x" else 4
            digits, after = self.text[self.at:self.at + width], self.at + width
            if len(digits) != width:
                digits = ""
        try:
            value = int(digits, 16)
        except ValueError:
            raise self.fail(f"\\{kind} without its hex digits") from None
        self.at = after
        if value > MAX_CHAR:
            raise self.fail("a code point above U+10FFFF")
        return value


def _one(code: int) -> CharSet:
    return CharSet([(code, code)])


class _Builder:
    """Thompson's construction: places joined by empty moves (always, at the start only,
    at the end only) and by moves on a set of characters."""

    def __init__(self):
        self.empty: list[list[tuple[str, int]]] = []
        self.moves: list[list[tuple[CharSet, int]]] = []

    def place(self) -> int:
        if len(self.moves) >= MAX_PLACES:
            raise PatternError(f"the pattern builds more than {MAX_PLACES} places "
                               f"(a long repeat such as {{1000}}?)")
        self.empty.append([])
        self.moves.append([])
        return len(self.moves) - 1

    def build(self, tree: Tree, begin: int, end: int) -> None:
        """Places from `begin` to `end` that read what `tree` matches."""
        kind = tree[0]
        if kind == "chars":
            if tree[1]:
                self.moves[begin].append((tree[1], end))
        elif kind in ("bol", "eol"):
            self.empty[begin].append((kind, end))
        elif kind == "alt":
            for option in tree[1]:
                self.build(option, begin, end)
        elif kind == "cat":
            at = begin
            for part in tree[1]:
                after = self.place()
                self.build(part, at, after)
                at = after
            self.empty[at].append(("", end))
        else:
            self._repeat(tree[1], tree[2], tree[3], begin, end)

    def _repeat(self, part: Tree, low: int, high: int | None, begin: int, end: int) -> None:
        at = begin
        for _ in range(low):
            after = self.place()
            self.build(part, at, after)
            at = after
        if high is None:                          # a loop: part, any number of times
            loop = self.place()
            self.empty[at].append(("", loop))
            again = self.place()
            self.build(part, loop, again)
            self.empty[again].append(("", loop))
            self.empty[loop].append(("", end))
            return
        for _ in range(high - low):               # each optional copy may end it
            self.empty[at].append(("", end))
            after = self.place()
            self.build(part, at, after)
            at = after
        self.empty[at].append(("", end))


def bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class StringRule:
    """The characters of a string that a pattern (None: any) and lengths allow. A state
    is (places, count): the set of places as bits, and the characters read so far
    (counted up to what the lengths need to tell apart)."""

    def __init__(self, pattern: str | None = None, min_length: int = 0,
                 max_length: int | None = None):
        self.pattern, self.min_length, self.max_length = pattern, min_length, max_length
        builder = _Builder()
        start, final = builder.place(), builder.place()
        tree = _Parser(pattern).parse() if pattern is not None else ("cat", [])
        anywhere = ("repeat", ("chars", ANY), 0, None)
        builder.build(("cat", [anywhere, tree, anywhere]), start, final)
        self.moves = builder.moves
        size = len(self.moves)
        # closures[(at start, at end)][place]: the places its empty moves reach
        self.closures = {(bol, eol): [self._closure(builder.empty, place, bol, eol)
                                      for place in range(size)]
                         for bol in (False, True) for eol in (False, True)}
        self.final = 1 << final
        # Counts are told apart up to the cap (past it only "beyond" matters), and 0
        # from the rest always: ^ holds at the string's start alone.
        self.cap = max_length if max_length is not None else max(min_length, 1)
        if (self.cap + 1) * size > MAX_TABLE:
            raise PatternError(f"the pattern and lengths need a table of more than "
                               f"{MAX_TABLE} entries")
        self.begin = (self.closures[True, False][start], 0)
        self._live = self._live_table()
        self._distances = self._distance_table()
        self._steps: dict[tuple[int, int], int] = {}
        self._distance_of: dict[int, float] = {}      # places -> distance(places)

    @staticmethod
    def _closure(empty: list, place: int, bol: bool, eol: bool) -> int:
        reached, pending = 1 << place, [place]
        while pending:
            for kind, target in empty[pending.pop()]:
                allowed = kind == "" or (kind == "bol" and bol) or (kind == "eol" and eol)
                if allowed and not reached >> target & 1:
                    reached |= 1 << target
                    pending.append(target)
        return reached

    def _union(self, mask: int, bol: bool, eol: bool) -> int:
        closures, found = self.closures[bol, eol], 0
        for place in bits(mask):
            found |= closures[place]
        return found

    def _live_table(self) -> list[int]:
        """live[c]: the places from which, with c characters read, the string can still
        end an instance (c up to the cap, the last standing for all beyond)."""
        size, moving = len(self.moves), self.closures[False, False]
        ending = sum(1 << p for p in range(size)
                     if self.closures[False, True][p] & self.final)
        reach = [0] * size      # the places one character leads to from each place
        for place in range(size):
            for _, target in self.moves[place]:
                reach[place] |= moving[target]

        def before(live_after: int) -> int:
            return sum(1 << p for p in range(size) if reach[p] & live_after)

        if self.max_length is not None:
            live = [ending if self.max_length >= self.min_length else 0]
        else:                                   # beyond min_length: a fixed point
            live = [ending]
            while (grown := live[0] | before(live[0])) != live[0]:
                live[0] = grown
        for count in range(self.cap - 1, -1, -1):       # built from the cap down
            live.append(before(live[-1]) | (ending if count >= self.min_length else 0))
        return live[::-1]

    def live(self, state: tuple[int, int]) -> bool:
        places, count = state
        return bool(places & self._live[min(count, self.cap)])

    def may_read(self, state: tuple[int, int], low: int, high: int) -> bool:
        """Whether a character in [low, high] may come next (a partly written one:
        the range its bytes so far leave open)."""
        places, count = state
        if self.max_length is not None and count >= self.max_length:
            return False
        live, moving = self._live[min(count + 1, self.cap)], self.closures[False, False]
        return any(charset.meets(low, high) and moving[target] & live
                   for place in bits(places) for charset, target in self.moves[place])

    def least_chars(self, places: int, low: int, high: int) -> float:
        """The fewest characters to an end through a next one in [low, high], whatever
        the lengths (inf: none): with `count` read, may_read holds where count plus
        this is within the maxLength, past the minLength."""
        moving = self.closures[False, False]
        return 1 + min((self.distance(moving[target]) for place in bits(places)
                        for charset, target in self.moves[place]
                        if charset.meets(low, high)), default=float("inf"))

    def read(self, state: tuple[int, int], char: int) -> tuple[int, int] | None:
        """The state after one more character (None: it leads to no instance)."""
        places, count = state
        if not self.may_read(state, char, char):
            return None
        return self.step(places, char), min(count + 1, self.cap)

    def step(self, places: int, char: int) -> int:
        """The places after one more character, whatever the lengths."""
        key = (places, char)
        after = self._steps.get(key)
        if after is None:
            if len(self._steps) > CACHED_STEPS:
                self._steps.clear()
            targets = 0
            for place in bits(places):
                for charset, target in self.moves[place]:
                    if charset.meets(char, char):
                        targets |= 1 << target
            after = self._steps[key] = self._union(targets, False, False)
        return after

    def steps_by_class(self, places: int, bounds: Sequence[int]) -> list[int]:
        """step(places, char) for every class of characters at once: bounds (sorted)
        are the classes' lowest code points, and every range of the rule's character
        sets starts at one of them and ends just before one (or at the last code point),
        so that a class is wholly in a set or wholly out of it."""
        targets = [0] * len(bounds)
        for place in bits(places):
            for charset, target in self.moves[place]:
                for low, high in charset.ranges():
                    for within in range(bisect_left(bounds, low), bisect_right(bounds, high)):
                        targets[within] |= 1 << target
        unions: dict[int, int] = {}
        return [unions[t] if t in unions else unions.setdefault(t, self._union(t, False, False))
                for t in targets]

    def distance(self, places: int) -> float:
        """The fewest characters more after which the string may end, from `places`
        past its start, whatever the lengths (inf: it cannot end). Kept per set: a walk of
        the vocabulary asks it of the same few sets at every node."""
        distance = self._distance_of.get(places)
        if distance is None:
            if len(self._distance_of) > CACHED_STEPS:
                self._distance_of.clear()
            distance = self._distance_of[places] = min(
                (self._distances[place] for place in bits(places)), default=float("inf"))
        return distance

    def _distance_table(self) -> list[float]:
        """For each place, the fewest characters to an end (breadth first, backwards
        from the places where the string may end)."""
        size, moving = len(self.moves), self.closures[False, False]
        sources: list[list[int]] = [[] for _ in range(size)]   # one character before
        for place in range(size):
            for charset, target in self.moves[place]:
                if charset:
                    for after in bits(moving[target]):
                        sources[after].append(place)
        found = [0.0 if self.closures[False, True][p] & self.final else float("inf")
                 for p in range(size)]
        pending = deque(p for p in range(size) if found[p] == 0)
        while pending:
            place = pending.popleft()
            for source in sources[place]:
                if found[source] == float("inf"):
                    found[source] = found[place] + 1
                    pending.append(source)
        return found

    def may_end(self, state: tuple[int, int]) -> bool:
        """Whether the string may close here."""
        places, count = state
        return count >= self.min_length and \
            bool(self._union(places, count == 0, True) & self.final)

    def matches(self, text: str) -> bool:
        """Whether `text` is a string the rule allows (tests and checks)."""
        state: tuple[int, int] | None = self.begin
        for char in text:
            state = self.read(state, ord(char))
            if state is None:
                return False
        return self.may_end(state)
