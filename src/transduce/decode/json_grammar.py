"""JSON text as an automaton over bytes: which bytes may come next, so that generation
can keep a reply to JSON (decode/constrained.py masks the tokens whose bytes it refuses).

A grammar is a graph of nodes, one per part of the JSON a schema allows
(json_schema.py compiles one): a literal, a string, a number, an object (free, or with
named properties in order), an array, a choice; and, around JSON, a sequence of parts
and a part repeated (reply_grammar.py: a forced tool call's tags). Reading a value is a stack of frames
(node, local state): a container that reaches a value pushes the value's node, and a
node that may end pops back when the next byte is its parent's. Where a byte is read
several ways (a choice, an optional property), every way is kept, so a state is the
frozenset of the stacks still alive; it is hashable, and masks are cached by it.

Whitespace between tokens is allowed as json.dumps and pretty-printers write it: one
space, or a newline and at most MAX_INDENT spaces or tabs of indentation (llama.cpp's
JSON grammar's rule; a model that writes whitespace forever cannot stall there), and
numbers take at most MAX_DIGITS digits a part, so that every state leads to an end.
Strings take whole UTF-8 characters but '"', '\\' and control characters, and the
escapes of RFC 8259.
"""

from __future__ import annotations

import zlib
from typing import Iterable

MAX_INDENT = 16
MAX_DIGITS = 18            # an integer part's, a fraction's (an exponent's: 3)
WHITESPACE = frozenset(b" \n\t")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPED = frozenset(b'"\\/bfnrt')

Move = tuple[object, "Node | None"]    # (the node's next local state, a child it starts)


class Node:
    """One part of a grammar. feed(local, byte) -> the moves the byte allows: (local',
    None), the byte read here, or (local', child), the byte starts `child`, after which
    this node is at local'. done(local): it may end here; final(local): it has ended,
    nothing more is read."""

    begin: object = 0
    written_with = b""          # the bytes its kind of value needs to be written whole

    def feed(self, local, byte: int) -> Iterable[Move]:
        raise NotImplementedError

    def done(self, local) -> bool:
        raise NotImplementedError

    def final(self, local) -> bool:
        return False

    def expects(self, local) -> frozenset[int] | None:
        """The bytes it may read next, where it can say cheaply and none ends it (a
        literal's next one); None: ask feed byte by byte."""
        return None


class Literal(Node):
    """Exactly these bytes (a key with its quotes, true, an enum's value)."""

    def __init__(self, text: bytes):
        self.text = text

    def feed(self, at: int, byte: int) -> Iterable[Move]:
        return ((at + 1, None),) if at < len(self.text) and self.text[at] == byte else ()

    def done(self, at: int) -> bool:
        return at == len(self.text)

    final = done

    def expects(self, at: int) -> frozenset[int] | None:
        return frozenset((self.text[at],)) if 0 < at < len(self.text) else None


class String(Node):
    """A JSON string: '"', characters (whole UTF-8 ones) or escapes, '"'."""

    OPEN, BODY, ESCAPE, CLOSED = 0, 1, 2, 7      # 3..6: \\u's hex digits, 4 left .. 1
    # 8 + k: inside a UTF-8 character, k + 1 continuation bytes to come (any of
    # 0x80..0xBF); 11..14: its first, narrowed after E0, ED, F0 or F4 (UTF8_NARROWED)
    written_with = b'"'

    def feed(self, at: int, byte: int) -> Iterable[Move]:
        if at == self.BODY:
            if byte == 0x22:
                return ((self.CLOSED, None),)
            if byte == 0x5C:
                return ((self.ESCAPE, None),)
            if byte < 0x80:
                return ((self.BODY, None),) if byte >= 0x20 else ()
            lead = utf8_lead(byte)
            return ((UTF8_NARROWED.get(byte, 7 + lead[0]), None),) if lead else ()
        if at >= 8:
            if at >= 11:
                low, high, left = UTF8_FIRST[at]
                return ((7 + left - 1, None),) if low <= byte <= high else ()
            return ((at - 1 if at > 8 else self.BODY, None),) if 0x80 <= byte < 0xC0 else ()
        if at == self.OPEN:
            return ((self.BODY, None),) if byte == 0x22 else ()
        if at == self.ESCAPE:
            if byte in ESCAPED:
                return ((self.BODY, None),)
            return ((3, None),) if byte == 0x75 else ()          # \u
        if 3 <= at <= 6 and byte in HEX:
            return ((self.BODY if at == 6 else at + 1, None),)
        return ()

    def done(self, at: int) -> bool:
        return at == self.CLOSED

    final = done


def utf8_lead(byte: int) -> tuple[int, int, int] | None:
    """For a UTF-8 lead byte: (continuation bytes to come, the range of the first), so
    that no overlong form, surrogate or code point past U+10FFFF is written; None for a
    byte that leads no character."""
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= byte <= 0xEF:
        return 2, 0xA0 if byte == 0xE0 else 0x80, 0x9F if byte == 0xED else 0xBF
    if 0xF0 <= byte <= 0xF4:
        return 3, 0x90 if byte == 0xF0 else 0x80, 0x8F if byte == 0xF4 else 0xBF
    return None


# String's local states after a lead byte whose first continuation byte is narrower
# than 0x80..0xBF, and that byte's range and the continuation bytes to come with it.
UTF8_NARROWED = {0xE0: 11, 0xED: 12, 0xF0: 13, 0xF4: 14}
UTF8_FIRST = {at: (*utf8_lead(lead)[1:], utf8_lead(lead)[0])
              for lead, at in UTF8_NARROWED.items()}


class Number(Node):
    """A JSON number (-? int frac? exp?), or an integer alone; local (phase, digits of
    the current part)."""

    # phases: start, after '-', a leading 0, integer digits, after '.', fraction digits,
    # after 'e', after its sign, exponent digits
    START, MINUS, ZERO, INT, DOT, FRACTION, E, SIGN, EXPONENT = range(9)
    ENDS = frozenset({ZERO, INT, FRACTION, EXPONENT})
    begin = (START, 0)
    written_with = b"0123456789"

    def __init__(self, integer: bool = False):
        self.integer = integer

    def feed(self, local: tuple[int, int], byte: int) -> Iterable[Move]:
        phase, digits = local
        if byte in DIGITS:
            return self._digit(phase, digits, byte)
        if byte == 0x2D and phase in (self.START, self.E):                      # -
            return (((self.MINUS if phase == self.START else self.SIGN, 0), None),)
        if byte == 0x2B and phase == self.E:                                    # +
            return (((self.SIGN, 0), None),)
        if self.integer:
            return ()
        if byte == 0x2E and phase in (self.ZERO, self.INT):                     # .
            return (((self.DOT, 0), None),)
        if byte in (0x65, 0x45) and phase in (self.ZERO, self.INT, self.FRACTION):  # e E
            return (((self.E, 0), None),)
        return ()

    def _digit(self, phase: int, digits: int, byte: int) -> Iterable[Move]:
        if phase in (self.START, self.MINUS):
            return (((self.ZERO if byte == 0x30 else self.INT, 1), None),)
        if phase in (self.INT, self.FRACTION, self.EXPONENT):
            limit = 3 if phase == self.EXPONENT else MAX_DIGITS
            return (((phase, digits + 1), None),) if digits < limit else ()
        if phase in (self.DOT, self.E, self.SIGN):
            return (((self.FRACTION if phase == self.DOT else self.EXPONENT, 1), None),)
        return ()                                               # after a leading 0

    def done(self, local: tuple[int, int]) -> bool:
        return local[0] in self.ENDS


class Choice(Node):
    """One of several nodes (a schema's anyOf or list of types, an enum; the root)."""

    CHOSEN = 1

    def __init__(self, options: Iterable[Node] = ()):
        self.options = list(options)

    def feed(self, at: int, byte: int) -> Iterable[Move]:
        return [(self.CHOSEN, option) for option in self.options] if at == 0 else ()

    def done(self, at: int) -> bool:
        return at == self.CHOSEN

    final = done


class Marker(Literal):
    """A literal the vocabulary writes as one token of its own (<think>): a vocabulary
    need not spell it byte by byte."""


# Symbols past the bytes: a special token a grammar names (Mistral's [TOOL_CALLS]) is
# read as one of these (TokenGrammar gives its id the symbol), never as bytes.
SPECIAL = 256


class Special(Literal):
    """A marker the vocabulary has as a special token (Mistral's [TOOL_CALLS]): read as
    that token's symbol, or as its text spelt out (where the vocabulary has no such
    token, or the model spells it), both of which decode to the same text."""

    def __init__(self, name: str):
        super().__init__(name.encode("utf-8"))
        self.name, self.symbol = name, special_symbol(name)

    def feed(self, at: int, byte: int) -> Iterable[Move]:
        if at == 0 and byte == self.symbol:
            return ((len(self.text), None),)
        return super().feed(at, byte)


def special_symbol(name: str) -> int:
    """The symbol a special token of this text is read as (one past the bytes)."""
    return SPECIAL + zlib.crc32(name.encode("utf-8"))


class TextUntil(Node):
    """Any bytes, up to and including the first `end` (a model's reasoning, up to
    </think>); local: how many of end's bytes the text ends with (KMP's table)."""

    def __init__(self, end: bytes):
        self.end = end
        self._fallback = [0] * len(end)     # the longest proper border of end[:i + 1]
        for at in range(1, len(end)):
            border = self._fallback[at - 1]
            while border and end[at] != end[border]:
                border = self._fallback[border - 1]
            self._fallback[at] = border + (end[at] == end[border])

    def feed(self, matched: int, byte: int) -> Iterable[Move]:
        if matched == len(self.end) or byte >= SPECIAL:
            return ()
        while matched and byte != self.end[matched]:
            matched = self._fallback[matched - 1]
        return ((matched + (byte == self.end[matched]), None),)

    def done(self, matched: int) -> bool:
        return matched == len(self.end)

    final = done


class Blank(Node):
    """Up to `most` spaces and newlines, or none (between a reasoning block and JSON)."""

    def __init__(self, most: int):
        self.most = most

    def feed(self, count: int, byte: int) -> Iterable[Move]:
        return ((count + 1, None),) if byte in (0x20, 0x0A) and count < self.most else ()

    def done(self, count: int) -> bool:
        return True


class Sequence(Node):
    """Its parts one after another (a tool call's opening tag, its JSON, its closing tag);
    local: the index of the part to come."""

    def __init__(self, parts: Iterable[Node]):
        self.parts = list(parts)

    def feed(self, at: int, byte: int) -> Iterable[Move]:
        return ((at + 1, self.parts[at]),) if at < len(self.parts) else ()

    def done(self, at: int) -> bool:
        return at == len(self.parts)

    final = done


class Repeat(Node):
    """`item` low to high times (None: no limit; low at least 1), `separator` between
    two; local: (items so far, whether an item comes next)."""

    begin = (0, True)

    def __init__(self, item: Node, low: int = 1, high: int | None = None,
                 separator: Node | None = None):
        self.item, self.low, self.high, self.separator = item, low, high, separator

    def feed(self, local: tuple[int, bool], byte: int) -> Iterable[Move]:
        count, item_next = local
        if item_next:
            return (((count + 1, False), self.item),)
        if self.separator is None:             # (at `high` items, it is final: popped)
            return (((count + 1, False), self.item),)
        return (((count, True), self.separator),)

    def done(self, local: tuple[int, bool]) -> bool:
        return not local[1] and local[0] >= self.low

    def final(self, local: tuple[int, bool]) -> bool:
        return self.done(local) and self.high is not None and local[0] >= self.high


class Container(Node):
    """What objects and arrays share: whitespace between their parts, kept in the local
    state's last place: 0 none yet, 1 one space, 2 + k a newline and k spaces or tabs."""

    CLOSED = -1

    @staticmethod
    def spaced(local: tuple, byte: int) -> Iterable[Move]:
        run = local[-1]
        if run == 0 and byte in (0x20, 0x0A):
            return ((local[:-1] + (1 if byte == 0x20 else 2,), None),)
        if run >= 2 and byte in (0x20, 0x09) and run - 2 < MAX_INDENT:
            return ((local[:-1] + (run + 1,), None),)
        return ()

    def done(self, local: tuple) -> bool:
        return local[0] == self.CLOSED

    final = done


class Object(Container):
    """A JSON object. With properties, (key node, value node, required) in order: the
    keys come in that order, a required one always, an optional one or not, and no
    others. Without (properties None): any string keys, each value `values`. Local:
    (phase, index of the property at hand, whitespace run)."""

    OPEN, FIRST, COLON, VALUE, AFTER, NEXT = range(6)
    begin = (OPEN, 0, 0)
    written_with = b'{}:,"'

    def __init__(self, properties: Iterable[tuple[Node, Node, bool]] | None,
                 values: Node | None = None):
        self.properties = None if properties is None else list(properties)
        self.values, self.keys = values, String()

    def feed(self, local: tuple[int, int, int], byte: int) -> Iterable[Move]:
        phase, index, _ = local
        if phase == self.OPEN:
            return (((self.FIRST, 0, 0), None),) if byte == 0x7B else ()
        moves = list(self.spaced(local, byte))
        if phase in (self.FIRST, self.NEXT):
            moves += [((self.COLON, key, 0), node) for key, node in self._keys_from(index)]
            if phase == self.FIRST and byte == 0x7D and self._may_close(index):
                moves.append(((self.CLOSED, 0, 0), None))
        elif phase == self.COLON and byte == 0x3A:
            moves.append(((self.VALUE, index, 0), None))
        elif phase == self.VALUE and byte not in WHITESPACE:
            moves.append(((self.AFTER, index + 1, 0), self._value(index)))
        elif phase == self.AFTER:
            if byte == 0x2C and next(iter(self._keys_from(index)), None):
                moves.append(((self.NEXT, index, 0), None))
            elif byte == 0x7D and self._may_close(index):
                moves.append(((self.CLOSED, 0, 0), None))
        return moves

    def _keys_from(self, index: int) -> Iterable[tuple[int, Node]]:
        """(index, key node) of each property that may come next: the one at `index` and
        those after it that only optional ones stand before."""
        if self.properties is None:
            return ((0, self.keys),)
        found = []
        for at in range(index, len(self.properties)):
            found.append((at, self.properties[at][0]))
            if self.properties[at][2]:
                break
        return found

    def _may_close(self, index: int) -> bool:
        return self.properties is None or not any(
            required for _, _, required in self.properties[index:])

    def _value(self, index: int) -> Node:
        return self.values if self.properties is None else self.properties[index][1]


class Array(Container):
    """A JSON array, min_items to max_items values (None: no limit): the first ones
    `prefix`'s, one each in order (a tuple's), the others `items`' (None: no others).
    Local: (phase, items so far, whitespace run)."""

    OPEN, FIRST, AFTER, NEXT = range(4)
    begin = (OPEN, 0, 0)
    written_with = b"[],"

    def __init__(self, items: Node | None, min_items: int = 0, max_items: int | None = None,
                 prefix: Iterable[Node] = ()):
        self.items, self.min_items, self.max_items = items, min_items, max_items
        self.prefix = list(prefix)

    def feed(self, local: tuple[int, int, int], byte: int) -> Iterable[Move]:
        phase, count, _ = local
        if phase == self.OPEN:
            return (((self.FIRST, 0, 0), None),) if byte == 0x5B else ()
        moves = list(self.spaced(local, byte))
        closes = byte == 0x5D and count >= self.min_items
        if phase in (self.FIRST, self.NEXT) and byte not in WHITESPACE \
                and byte != 0x5D and self._room(count):
            moves.append(((self.AFTER, count + 1, 0), self.item(count)))
        if phase == self.FIRST and closes:
            moves.append(((self.CLOSED, 0, 0), None))
        elif phase == self.AFTER:
            if byte == 0x2C and self._room(count):
                moves.append(((self.NEXT, count, 0), None))
            elif closes:
                moves.append(((self.CLOSED, 0, 0), None))
        return moves

    def item(self, index: int) -> Node | None:
        """The node of the value at `index`."""
        return self.prefix[index] if index < len(self.prefix) else self.items

    def _room(self, count: int) -> bool:
        return (self.max_items is None or count < self.max_items) \
            and self.item(count) is not None


class Root(Container):
    """The whole text: one space at most (a SentencePiece reply's first piece may begin
    with one), then one value, then nothing."""

    begin = (0, 0)

    def __init__(self, value: Node):
        self.value = value

    def feed(self, local: tuple[int, int], byte: int) -> Iterable[Move]:
        if local[0] == self.CLOSED:
            return ()
        if byte == 0x20 and local == (0, 0):
            return (((0, 1), None),)
        return (((self.CLOSED, 0), self.value),)


def any_value() -> Node:
    """Any JSON value: objects and arrays of any values, strings, numbers, literals."""
    value = Choice()
    value.options = [Object(None, value), Array(value), String(), Number(),
                     Literal(b"true"), Literal(b"false"), Literal(b"null")]
    return value


def needed_bytes(root: Node) -> frozenset[int]:
    """The bytes a text of the grammar may need to go on from anywhere: its literals'
    (keys, enum values, tags) and its kinds of value's."""
    found: set[int] = set()
    for node in _nodes(root):
        found.update(node.text if type(node) is Literal else node.written_with)
    return frozenset(found)


def specials(root: Node) -> set[str]:
    """The special tokens' texts the grammar names (Special nodes)."""
    return {node.name for node in _nodes(root) if isinstance(node, Special)}


def _nodes(root: Node) -> Iterable[Node]:
    """Every node of the grammar once (it may have cycles: a recursive schema)."""
    seen: set[int] = set()
    pending = [root]
    while pending:
        node = pending.pop()
        if id(node) not in seen:
            seen.add(id(node))
            yield node
            pending.extend(_children(node))


def _children(node: Node) -> list[Node]:
    if isinstance(node, Object):
        return [node.keys, *([node.values] if node.values is not None else []),
                *(part for key, value, _ in node.properties or () for part in (key, value))]
    children = {Choice: lambda: node.options, Sequence: lambda: node.parts,
                Array: lambda: [*node.prefix, *([node.items] if node.items else [])],
                Root: lambda: [node.value],
                Repeat: lambda: [node.item] + ([node.separator] if node.separator else [])}
    return list(children[type(node)]()) if type(node) in children else []


Stack = tuple[tuple[Node, object], ...]
State = frozenset          # of Stacks


def start(root: Node) -> State:
    """The state before the first byte of a text of `root`."""
    return frozenset({((root, root.begin),)})


def advance(state: State, data: Iterable[int]) -> State:
    """The state after `data`, bytes or special symbols (empty: they are not what the
    grammar allows)."""
    for byte in data:
        following: set[Stack] = set()
        for stack in state:
            _feed(stack, byte, following)
        if not following:
            return frozenset()
        state = frozenset(following)
    return state


def _feed(stack: Stack, byte: int, into: set[Stack]) -> None:
    """Every stack `stack` becomes by reading `byte`, ended frames popped, into `into`."""
    node, local = stack[-1]
    below = stack[:-1]
    for after, child in node.feed(local, byte):
        if child is None:
            into.add(_popped(below + ((node, after),)))
        else:
            _feed(below + ((node, after), (child, child.begin)), byte, into)
    if below and node.done(local):           # it may end here: the byte is its parent's
        _feed(below, byte, into)


def _popped(stack: Stack) -> Stack:
    """Frames that have ended (a closed string or object) leave the stack; the root's
    stays, so that an ended text is one stack of one frame."""
    while len(stack) > 1 and stack[-1][0].final(stack[-1][1]):
        stack = stack[:-1]
    return stack


def complete(state: State) -> bool:
    """Whether the bytes so far are a whole text of the grammar (an end token may come)."""
    return any(all(node.done(local) for node, local in stack) for stack in state)


def ended(state: State) -> bool:
    """Whether the text is whole and nothing can follow it (the root value closed)."""
    return bool(state) and all(len(stack) == 1 and stack[0][0].final(stack[0][1])
                               for stack in state)


def next_bytes(state: State) -> frozenset[int] | None:
    """The only bytes that may come next, where every stack's top frame says which (in a
    literal: a key, an enum's value, true); None where any of them cannot say."""
    found: set[int] = set()
    for stack in state:
        node, local = stack[-1]
        expected = node.expects(local)
        if expected is None:
            return None
        found |= expected
    return frozenset(found)


def indentation(state: State) -> tuple[State, int] | None:
    """(the state at no indentation, the room left) where every stack is in a container's
    whitespace after a newline, all as far in: there a token is read as at no indentation
    but for its leading spaces and tabs, of which `room` (MAX_INDENT less those written)
    may still come. None elsewhere."""
    runs = {stack[-1][1][-1] if isinstance(stack[-1][0], Container) else 0 for stack in state}
    if len(runs) != 1 or (run := runs.pop()) < 3:
        return None
    return frozenset(stack[:-1] + ((stack[-1][0], stack[-1][1][:-1] + (2,)),)
                     for stack in state), MAX_INDENT - (run - 2)
