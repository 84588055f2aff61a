"""Strings kept to a pattern, a format's shape and lengths, numbers kept within bounds and
to a multiple: the texts the grammar reads whole are exactly the instances (against
Python's re and plain arithmetic, over every short text of a small alphabet), and every
prefix it reads can still end one, so generation never writes itself into a corner."""

import datetime
import ipaddress
import itertools
import json
import random
import re
import uuid
from fractions import Fraction

import pytest

from transduce.decode.json_grammar import advance, complete, start
from transduce.decode.json_schema import compile_schema, schema_node
from transduce.decode.regex_automaton import PatternError, StringRule
from transduce.decode.string_formats import FORMATS

# (pattern, its Python form where it differs): ECMA's $ never matches before a newline
PATTERNS = ["^a+b?$", "ab", "^(a|b)*-$", "b{2,3}", "^[ab]{1,2}(-[^-])?$", "^-?a{0,2}$",
            "^(?:ab|ba)+$", "[^a]a$", r"^\w-\d?$", "^(a|)b*$", r"^\-?[a-b]+\.?$", "^$",
            "a|^b", "^.b", r"[\s\S]-", "a^|ab", "(^|-)a", "a$|-"]
ALPHABET = "ab-1.\n"


def reference(pattern: str) -> re.Pattern:
    return re.compile(re.sub(r"\$(?=$|[)|])", r"\\Z", pattern), re.ASCII)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_matches_where_python_s_re_finds_it(pattern):
    rule, theirs = StringRule(pattern), reference(pattern)
    for length in range(5):
        for chars in itertools.product(ALPHABET, repeat=length):
            text = "".join(chars)
            assert rule.matches(text) == bool(theirs.search(text)), (pattern, text)


def texts(alphabet: bytes, longest: int):
    for length in range(longest + 1):
        for chars in itertools.product(alphabet, repeat=length):
            yield bytes(chars)


def assert_reads_exactly(root, alphabet: bytes, longest: int, is_instance) -> int:
    """Every text of `alphabet` up to `longest` bytes: read whole iff an instance; and
    every prefix read goes on to a whole text within the budget of bytes left. Returns
    the count of instances found."""
    found = 0
    for text in texts(alphabet, longest):
        state = advance(start(root), text)
        whole = bool(state) and complete(state)
        assert whole == is_instance(text), text
        found += whole
    return found


def can_end(root, text: bytes, alphabet: bytes, budget: int, visits: int = 2000) -> bool:
    """Whether `text` goes on to a whole text within `budget` more bytes, found depth
    first among at most `visits` states (where every state read can end, the first
    path found does)."""
    pending = [(advance(start(root), text), budget)]
    while pending and visits:
        state, left = pending.pop()
        visits -= 1
        if complete(state):
            return True
        if left:
            pending.extend((after, left - 1) for byte in alphabet
                           if (after := advance(state, bytes([byte]))))
    return False


@pytest.mark.parametrize("pattern, low, high", [
    ("^a+b?$", 0, None), ("^(aa)+$", 0, 5), ("b", 2, 3), (None, 1, 3), ("^(a|b)*-$", 3, None),
    ("^[ab]{1,2}(-[^-])?$", 0, 3), ("^(ab|ba)+$", 3, 4)])
def test_a_checked_string_reads_exactly_its_instances_and_never_stalls(pattern, low, high):
    schema = {"type": "string", "minLength": low, **({"maxLength": high} if high else {})}
    root = compile_schema({**schema, **({"pattern": pattern} if pattern else {})})
    theirs = reference(pattern) if pattern else re.compile("")

    def instance(text: bytes) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, str) and bool(theirs.search(value)) \
            and low <= len(value) <= (high or 99)

    assert assert_reads_exactly(root, b'"ab-\\', 7, instance) > 0
    for text in texts(b'"ab-', 5):
        if advance(start(root), text):
            assert can_end(root, text, b'"ab-', 8), text


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": -12, "maximum": 7, "multipleOf": 3},
    {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 40},
    {"type": "integer", "minimum": 95, "maximum": 105},
    {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5, "multipleOf": 0.25},
    {"type": "number", "minimum": 10, "maximum": 10},
    {"type": "integer", "maximum": -3},
    {"type": "integer", "minimum": 5, "exclusiveMinimum": True},       # draft 4's flag
    {"type": "number", "minimum": 0.5, "maximum": 30},
    {"type": "number", "exclusiveMinimum": -20, "maximum": -1},
    {"type": "integer", "minimum": -105, "maximum": -95},
    {"type": "integer", "minimum": 1, "maximum": 99999},
    {"type": "number", "minimum": 0, "maximum": 20, "multipleOf": 1},
])
def test_a_bounded_number_reads_exactly_its_instances_and_never_stalls(schema):
    root, alphabet = compile_schema(schema), b"-0123.59"
    low = Fraction(str(schema.get("minimum", schema.get("exclusiveMinimum", -10 ** 9))))
    high = Fraction(str(schema.get("maximum", schema.get("exclusiveMaximum", 10 ** 9))))
    open_low = "exclusiveMinimum" in schema
    step = Fraction(str(schema.get("multipleOf", 1 if schema["type"] == "integer" else 0)))

    def instance(text: bytes) -> bool:
        if not re.fullmatch(rb"-?(0|[1-9]\d*)(\.\d+)?", text) or \
                (schema["type"] == "integer" and b"." in text):
            return False
        value = Fraction(text.decode())
        return (low < value if open_low else low <= value) and \
            (value < high if "exclusiveMaximum" in schema else value <= high) and \
            (not step or value % step == 0)

    assert assert_reads_exactly(root, alphabet, 5, instance) > 0
    for text in texts(alphabet, 4):
        if advance(start(root), text):
            assert can_end(root, text, b"0123456789.-", 20), text


def test_a_bounded_number_is_written_without_an_exponent_and_with_at_most_18_digits():
    root = compile_schema({"type": "number", "minimum": 0})
    assert not advance(start(root), b"1e5")
    assert complete(advance(start(root), b"9" * 18 + b"." + b"9" * 18))
    assert not advance(start(root), b"9" * 19)
    assert not advance(start(compile_schema({"type": "integer", "minimum": 10 ** 17})),
                       b"-")


def test_numbers_of_one_future_share_a_state_and_a_split_one_keeps_its_text():
    """Generated numbers differ from request to request: a state per text would make
    each a new mask to find."""
    within = {"type": "integer", "minimum": 1, "maximum": 99999}
    root = compile_schema(within)
    assert advance(start(root), b"347") == advance(start(root), b"512") \
        != advance(start(root), b"3470")
    assert len({advance(start(root), str(n).encode()) for n in range(1, 100000, 7)}) == 5
    split = compile_schema({"type": "integer", "minimum": 0, "maximum": 150})
    assert advance(start(split), b"16") == advance(start(split), b"17") \
        != advance(start(split), b"15")
    reals = compile_schema({"type": "number", "minimum": -30, "maximum": 0.5})
    assert advance(start(reals), b"-12.5") == advance(start(reals), b"-17.0")
    assert advance(start(reals), b"-3") != advance(start(reals), b"-2") \
        == advance(start(reals), b"-1")                   # -30 splits the spans of -3
    stepped = compile_schema({"type": "integer", "minimum": 1, "multipleOf": 5})
    assert advance(start(stepped), b"12") != advance(start(stepped), b"13")


def walk_string(rule_schema, rng, limit=80) -> str:
    """A random string of the grammar, bytes drawn among the ASCII ones allowed."""
    root = compile_schema(rule_schema)
    state, text = advance(start(root), b'"'), b'"'
    while not complete(state):
        options = [byte for byte in range(0x20, 0x80)
                   if advance(state, bytes([byte]))]
        weights = [0.2 if byte == 0x5C else 5 if byte == 0x22 and len(text) > limit else 1
                   for byte in options]
        byte = rng.choices(options, weights)[0]
        state, text = advance(state, bytes([byte])), text + bytes([byte])
    return json.loads(text)


@pytest.mark.parametrize("name", FORMATS)
def test_generated_strings_have_their_format_s_shape(name):
    rng, theirs = random.Random(name), reference(FORMATS[name])
    for _ in range(20):
        value = walk_string({"type": "string", "format": name}, rng)
        assert theirs.search(value), value
        if name == "uuid":
            assert str(uuid.UUID(value)) == value.lower()
        elif name == "ipv4":
            assert str(ipaddress.IPv4Address(value)) == value
        elif name == "ipv6":
            ipaddress.IPv6Address(value)
        elif name == "email":
            local, domain = value.split("@")
            assert local and "." in domain


def test_a_date_is_a_calendar_s_and_unknown_formats_are_annotations():
    rule = StringRule(FORMATS["date"])
    for year in (1, 4, 100, 1900, 2000, 2023, 2024, 9999):
        for month, day in itertools.product(range(0, 14), range(0, 33)):
            text = f"{year:04}-{month:02}-{day:02}"
            try:
                real = bool(datetime.date.fromisoformat(text))
            except ValueError:
                real = False
            assert rule.matches(text) == real, text
    assert not rule.matches("0000-01-01")
    date = compile_schema({"type": "string", "format": "date"})
    assert not advance(start(date), b'"2024-13')
    other = compile_schema({"type": "string", "format": "idn-email"})
    assert complete(advance(start(other), b'"anything"'))
    both = compile_schema({"type": "string", "format": "date", "pattern": "^x$"})
    assert complete(advance(start(both), b'"x"'))                      # the pattern wins


def test_characters_are_checked_whole_raw_or_escaped_and_refused_at_their_first_byte():
    accented = compile_schema({"type": "string", "pattern": "^[é-ü]{2}$"})
    for text in ['"éü"', '"\\u00e9\\u00FC"', '"é\\u00fc"']:
        assert complete(advance(start(accented), text.encode())), text
    assert not advance(start(accented), '"ab"'.encode())
    assert not advance(start(accented), '"\\u00e8'.encode())      # below é, refused at 8
    assert advance(start(accented), b'"\\u00e')
    assert not advance(start(accented), b'"\\u01')              # no code point of 01xx
    assert not advance(start(accented), '"中'.encode()[:2])     # no 3-byte one either
    letters = compile_schema({"type": "string", "pattern": "^[a-z]*$"})
    assert not advance(start(letters), b'"\xc3')                  # at the lead byte
    surrogate = compile_schema({"type": "string", "pattern": "."})
    assert not advance(start(surrogate), b'"\\ud83d')
    assert not advance(start(surrogate), b'"\xed\xa0')            # UTF-8 of a surrogate
    counted = compile_schema({"type": "string", "maxLength": 2})
    assert complete(advance(start(counted), '"中\\n"'.encode()))   # characters, not bytes
    assert not advance(start(counted), '"中\\n🙂'.encode())


def test_a_plain_string_takes_no_overlong_surrogate_or_out_of_range_utf8():
    root = compile_schema({"type": "string"})
    for good in ["é", "中", "🙂", "\U0010ffff", "\ud7ff"]:
        assert complete(advance(start(root), f'"{good}"'.encode()))
    for bad in [b"\xc0\x80", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x80\x80\x80",
                b"\xf4\x90\x80\x80", b"\xf5"]:
        assert not advance(start(root), b'"' + bad), bad


def test_assertions_keep_to_their_type_and_enum_values_to_the_rest_of_their_schema():
    short = compile_schema({"maxLength": 2})          # no type: any value, short strings
    assert complete(advance(start(short), b'"ab"'))
    assert not advance(start(short), b'"abc')
    assert complete(advance(start(short), b"[1, 2, 3]"))
    enum = compile_schema({"enum": ["a", "bbb", 1], "type": "string", "maxLength": 2})
    assert complete(advance(start(enum), b'"a"'))
    assert not advance(start(enum), b'"b') and not advance(start(enum), b"1")


def test_prefix_items_are_a_tuple_s_values_in_order():
    pair = compile_schema({"type": "array", "prefixItems": [{"type": "integer"},
                                                            {"type": "string"}],
                           "minItems": 2, "maxItems": 2})
    assert complete(advance(start(pair), b'[1, "a"]'))
    assert not advance(start(pair), b'["a"') and not advance(start(pair), b'[1, 2')
    assert not advance(start(pair), b'[1, "a",')
    rest = compile_schema({"prefixItems": [{"const": 0}], "items": {"type": "boolean"}})
    assert complete(advance(start(rest), b"[0, true, false]"))
    assert complete(advance(start(rest), b"[]"))
    assert not advance(start(rest), b"[1")


def test_a_tool_s_pattern_it_cannot_keep_is_read_past_and_one_it_can_is_kept():
    lenient = schema_node({"type": "string", "pattern": "^(?!x)"}, lenient=True)
    assert complete(advance(start(lenient), b'"x"'))
    kept = schema_node({"type": "string", "pattern": "^y$"}, lenient=True)
    assert not advance(start(kept), b'"x')
    with pytest.raises(PatternError, match="at character 0 of"):
        StringRule("*a")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_fewest_characters_to_an_end_are_the_shortest_completion(pattern):
    """StringRule.distance (kept per set of places) after every text of one or two
    characters: the length of the shortest text after it that completes an instance
    (more than four where none of up to four does), asked twice, the second time in
    the other order, so that kept answers are read back."""
    rule = StringRule(pattern)
    cases = []
    for length in range(1, 3):
        for chars in itertools.product(ALPHABET, repeat=length):
            places = rule.begin[0]
            for char in chars:
                places = rule.step(places, ord(char))
            shortest = next((n for n in range(5) for suffix in itertools.product(
                ALPHABET, repeat=n) if rule.matches("".join(chars + suffix))), None)
            cases.append((places, shortest, chars))
    for places, shortest, chars in cases + cases[::-1]:
        distance = rule.distance(places)
        assert distance == shortest if shortest is not None else distance > 4, (pattern, chars)
