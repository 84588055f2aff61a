"""Values whose assertions the grammar keeps as it reads them (json_grammar.py's nodes):
a string checked by a StringRule (a pattern, a format's shape, lengths), and a number
within bounds and of a multiple. Each refuses a byte as soon as no instance can follow
from it, so generation never writes itself into a value it cannot end.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from typing import Iterable

from transduce.decode.json_grammar import DIGITS, HEX, MAX_DIGITS, Move, Node, Number, utf8_lead
from transduce.decode.regex_automaton import StringRule

# The characters the escapes of RFC 8259 but \u stand for.
SINGLE_ESCAPES = {ord(k): ord(v) for k, v in
                  {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}.items()}
LEAD_BITS = {1: 0x1F, 2: 0x0F, 3: 0x07}     # a lead byte's bits of its code point
CACHED_TEXTS = 4096                          # a NumberRange's answers kept, each kind


class CheckedString(Node):
    """A JSON string whose characters a StringRule allows. Local: (phase, the character
    being written, as (code point so far, units to come[, next byte's range]), the
    rule's state)."""

    OPEN, BODY, ESCAPE, HEX, UTF8, CLOSED = range(6)
    begin = (OPEN, None, None)
    written_with = b'"'

    def __init__(self, rule: StringRule):
        self.rule = rule

    def feed(self, local: tuple, byte: int) -> Iterable[Move]:
        phase, partial, state = local
        if phase == self.OPEN:
            begin = self.rule.begin
            return (((self.BODY, None, begin), None),) \
                if byte == 0x22 and self.rule.live(begin) else ()
        if phase == self.BODY:
            if byte == 0x22:
                return (((self.CLOSED, None, None), None),) if self.rule.may_end(state) else ()
            if byte == 0x5C:                      # any escape: a character up to U+FFFF
                return self._within(self.ESCAPE, None, state, 0, 0xFFFF)
            if byte < 0x80:
                return self._char(state, byte) if byte >= 0x20 else ()
            lead = utf8_lead(byte)
            if lead is None:
                return ()
            left, low, high = lead
            return self._utf8((byte & LEAD_BITS[left], left, low, high), state)
        if phase == self.ESCAPE:
            if byte == 0x75:                                               # \u
                return self._within(self.HEX, (0, 4), state, 0, 0xFFFF)
            code = SINGLE_ESCAPES.get(byte)
            return self._char(state, code) if code is not None else ()
        if phase == self.HEX and byte in HEX:
            value, left = partial
            value, left = value * 16 + int(chr(byte), 16), left - 1
            if not left:
                return self._char(state, value)
            return self._within(self.HEX, (value, left), state, *_hex_range((value, left)))
        if phase == self.UTF8:
            value, left, low, high = partial
            if not low <= byte <= high:
                return ()
            value, left = value << 6 | byte & 0x3F, left - 1
            if not left:
                return self._char(state, value)
            return self._utf8((value, left, 0x80, 0xBF), state)
        return ()

    def _utf8(self, partial: tuple[int, int, int, int], state) -> Iterable[Move]:
        return self._within(self.UTF8, partial, state, *_utf8_range(partial))

    def _within(self, phase: int, partial, state, low: int, high: int) -> Iterable[Move]:
        return (((phase, partial, state), None),) \
            if self.rule.may_read(state, low, high) else ()

    def _char(self, state, code: int) -> Iterable[Move]:
        after = self.rule.read(state, code)
        return (((self.BODY, None, after), None),) if after is not None else ()

    def done(self, local: tuple) -> bool:
        return local[0] == self.CLOSED

    final = done

    def finish(self, local: tuple) -> float:
        """The fewest characters to an end from `local` in the body, a character half
        written counted whole, whatever the lengths: with the count `local` holds, a
        byte that leads to it is read where the two are within the maxLength (past the
        minLength), so a token's bytes are read at every count where each is."""
        phase, partial, (places, _) = local
        if phase == self.BODY:
            return self.rule.distance(places)
        low, high = (0, 0xFFFF) if phase == self.ESCAPE else \
            _hex_range(partial) if phase == self.HEX else _utf8_range(partial)
        return self.rule.least_chars(places, low, high)

    def room(self, local: tuple) -> float | None:
        """Characters any plain text may still add here (where no pattern is kept and no
        character is half written), or None."""
        if local[0] != self.BODY or self.rule.pattern is not None:
            return None
        if self.rule.max_length is None:
            return float("inf")
        return self.rule.max_length - local[2][1]


def _hex_range(partial: tuple[int, int]) -> tuple[int, int]:
    """The code points a \\u escape with these hex digits so far may still make."""
    value, left = partial
    return value << 4 * left, ((value + 1) << 4 * left) - 1


def _utf8_range(partial: tuple[int, int, int, int]) -> tuple[int, int]:
    """The code points a UTF-8 character with these bytes so far may still make."""
    value, left, low, high = partial
    shift = 6 * (left - 1)
    base = value << 6 * left
    return base | (low & 0x3F) << shift, base | (high & 0x3F) << shift | ((1 << shift) - 1)


class Bound:
    """One end of a range of numbers: a value, and whether it belongs to the range."""

    def __init__(self, value: int | Fraction, closed: bool):
        self.value, self.closed = value, closed


class NumberRange:
    """Numbers within [low, high] (either open or absent) that are multiples of `step`
    (None: any): which prefixes of a number's text can still end within it."""

    def __init__(self, low: Bound | None, high: Bound | None,
                 step: int | Fraction | None):
        self.low, self.high, self.step = low, high, step
        # A trie walk asks of one text once a byte: answers are kept a while.
        self.reachable = lru_cache(CACHED_TEXTS)(self.reachable)
        self.ends_within = lru_cache(CACHED_TEXTS)(self.ends_within)
        self.held_spans = lru_cache(CACHED_TEXTS)(self.held_spans)

    def ends_within(self, text: bytes) -> bool:
        """Whether the number `text` is in the range."""
        value = Fraction(text.decode()) if b"." in text else int(text)
        return self.meets(Bound(value, True), Bound(value, True))

    def meets(self, low: Bound, high: Bound) -> bool:
        """Whether a number between `low` and `high` is in the range."""
        low, high = _tighter(low, self.low, 1), _tighter(high, self.high, -1)
        if self.step is None:
            return low.value < high.value or (low.value == high.value and low.closed
                                               and high.closed)
        first = -(-low.value // self.step) * self.step        # exact, ints or fractions
        if first == low.value and not low.closed:
            first += self.step
        return first < high.value or (first == high.value and high.closed)

    def held_spans(self, text: bytes, integers: bool) -> tuple[bool, ...] | None:
        """For an integer part `text` (an optional '-', then digits not led by 0), per
        count of digits still to come (0 first): whether every number it then begins is
        in the range (True) or none is (False). None where one span is split, or the
        range has a step (but integers of step 1): the future then hangs on the text
        itself. Texts of one answer have one future, so a grammar's states merge."""
        if self.step is not None and not (integers and self.step == 1):
            return None
        negative = text.startswith(b"-")
        start, held = int(text[1 if negative else 0:]), []
        for more in range(MAX_DIGITS - len(text) + negative + 1):
            low, high = start * 10 ** more, (start + 1) * 10 ** more   # [low, high): |value|
            if integers:
                lowest, highest = Bound(low, True), Bound(high - 1, True)
            else:
                lowest, highest = Bound(low, True), Bound(high, False)
            if negative:
                lowest, highest = Bound(-highest.value, highest.closed), \
                    Bound(-lowest.value, lowest.closed)
            if self.holds(lowest, highest):
                held.append(True)
            elif not self.meets(lowest, highest):
                held.append(False)
            else:
                return None
        return tuple(held)

    def holds(self, lowest: Bound, highest: Bound) -> bool:
        """Whether every number from `lowest` to `highest` is in the range (step aside)."""
        return _inside(lowest, self.low, 1) and _inside(highest, self.high, -1)

    def reachable(self, text: bytes) -> bool:
        """Whether a number whose text begins with `text` (no exponent; at most
        MAX_DIGITS digits a part) may end in the range."""
        if not text:                              # either sign may come
            return self.reachable(b"-") or self._spanned(False, b"")
        negative = text.startswith(b"-")
        return self._spanned(negative, text[1 if negative else 0:])

    def _spanned(self, negative: bool, text: bytes) -> bool:
        whole, dot, fraction = text.partition(b".")
        for low, high in _spans(whole, dot, fraction):      # of the absolute value
            if negative:
                found = self.meets(Bound(-high, False), Bound(-low, True))
                if not found and self.low is not None and -low < self.low.value:
                    return False                  # further spans only fall lower
            else:
                found = self.meets(Bound(low, True), Bound(high, False))
                if not found and self.high is not None and low > self.high.value:
                    return False
            if found:
                return True
        return False


def _tighter(bound: Bound, other: Bound | None, sign: int) -> Bound:
    """Of two lower (sign 1) or upper (-1) bounds, the one that cuts more."""
    if other is None or (bound.value - other.value) * sign > 0:
        return bound
    if bound.value == other.value:
        return Bound(bound.value, bound.closed and other.closed)
    return other


def _inside(end: Bound, bound: Bound | None, sign: int) -> bool:
    """Whether a lower (sign 1) or upper (-1) end of numbers is within `bound`."""
    if bound is None or (end.value - bound.value) * sign > 0:
        return True
    return end.value == bound.value and (bound.closed or not end.closed)


def _spans(whole: bytes, dot: bytes, fraction: bytes
           ) -> Iterable[tuple[int | Fraction, int | Fraction]]:
    """[low, high) spans the absolute value of a number whose text begins (after any
    sign) with whole[.fraction] may still take, smallest first."""
    if dot:
        low = Fraction(int(whole)) + Fraction(int(fraction or b"0"), 10 ** len(fraction))
        yield low, low + Fraction(1, 10 ** len(fraction))
    elif not whole:                  # (ints where they are: much faster than fractions)
        yield 0, 10 ** MAX_DIGITS
    elif whole == b"0":
        yield 0, 1
    else:
        start = int(whole)
        for more in range(MAX_DIGITS - len(whole) + 1):
            yield start * 10 ** more, (start + 1) * 10 ** more


class HeldSpans(tuple):
    """A number's text where NumberRange.held_spans answers it: (held, in the fraction)
    in its place, so that texts of one future are one local state."""

    def after(self, byte: int) -> "HeldSpans | None":
        """The answer after `byte` (None: no number in the range follows)."""
        held, fraction = self
        if byte in DIGITS and not fraction:
            held = held[1:]
            return HeldSpans((held, False)) if any(held) else None
        return HeldSpans((held[:1], True)) if held[0] else None     # '.', or a fraction digit


class BoundedNumber(Number):
    """A number (or an integer) in a NumberRange, written without an exponent. Local:
    (phase, digits of the current part, the text so far, or its HeldSpans where it has
    them)."""

    begin = (Number.START, 0, b"")

    def __init__(self, within: NumberRange, integer: bool = False):
        super().__init__(integer)
        self.within = within

    def feed(self, local: tuple[int, int, bytes | HeldSpans], byte: int) -> Iterable[Move]:
        if byte not in DIGITS and byte not in (0x2D, 0x2E):                # - .
            return ()
        moves = super().feed(local[:2], byte)
        text = local[2]
        if isinstance(text, HeldSpans):
            text = text.after(byte) if moves else None
            return () if text is None else [((phase, digits, text), None)
                                            for (phase, digits), _ in moves]
        text += bytes((byte,))
        if not moves or not self.within.reachable(text):
            return ()
        return [((phase, digits, self._kept(phase, text)), None) for (phase, digits), _ in moves]

    def _kept(self, phase: int, text: bytes) -> bytes | HeldSpans:
        held = self.within.held_spans(text, self.integer) if phase == self.INT else None
        return text if held is None else HeldSpans((held, False))

    def done(self, local: tuple[int, int, bytes | HeldSpans]) -> bool:
        if local[0] not in self.ENDS:
            return False
        text = local[2]
        return text[0][0] if isinstance(text, HeldSpans) else self.within.ends_within(text)
