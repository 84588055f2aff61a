"""The JSON automaton against Python's json module: what json.dumps writes is read whole,
what json.loads refuses is refused, and on short random texts the two agree."""

import json
import random
import re

import pytest

from transduce.decode.json_grammar import (MAX_DIGITS, MAX_INDENT, Literal, Root, Sequence,
                                           TextUntil, advance, any_value, complete, ended,
                                           start)

VALUES = [
    {}, [], "", 0, -0.5, 1e-7, 12345678901234567, True, False, None,
    {"a": 1, "b": [1, 2.5, -3e10, {"c": None}], "d": {"e": {"f": []}}},
    ["x", "é ü 中文 🙂", "quote \" backslash \\ slash / tab \t newline \n", "\u0001\u001f"],
    [[[[1]]], {"": ""}, {"k": {"k": {"k": "v"}}}],
    {"numbers": [0, -0, 10, 0.001, 123.456e+12, 1E5, -2.5E-3]},
]
WRITINGS = [dict(), dict(indent=2), dict(separators=(",", ":")), dict(ensure_ascii=False),
            dict(indent="\t", ensure_ascii=False)]
INVALID = ['{"a":}', '{"a" 1}', '{,}', '{"a":1,}', '[1,]', '[,1]', '01', '-', '1.', '.5',
           '1e', '+1', '"abc', '"\\x"', '"\\u12g4"', 'tru', 'nul', '{"a":1}}', '[1 2]',
           "{'a': 1}", '"tab\tinside"', '{"a":1} x', '[1]]', '"a"b']


def grammar():
    return Root(any_value())


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("writing", WRITINGS)
def test_what_json_dumps_writes_is_read_whole(value, writing):
    text = json.dumps(value, **writing)
    state = advance(start(grammar()), text.encode("utf-8"))
    assert state and complete(state)
    assert ended(state) == isinstance(value, (dict, list, str, bool)) or value is None


@pytest.mark.parametrize("text", INVALID)
def test_what_json_refuses_is_refused(text):
    with pytest.raises(ValueError):
        json.loads(text, strict=True)
    state = advance(start(grammar()), text.encode("utf-8"))
    assert not (state and complete(state))


def test_random_short_texts_are_json_exactly_when_the_grammar_reads_them_whole():
    """Texts of JSON's characters: where json.loads reads one (and it has no whitespace
    after the value, no run of two spaces outside strings, no number part longer than
    the caps), the grammar reads it whole, and where the grammar does, json.loads does."""
    alphabet = '{}[]",:0123456789.-+eE tfnrulas\\'
    rng, agreed = random.Random(0), 0
    for _ in range(40_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
        state = advance(start(grammar()), text.encode())
        read = bool(state) and complete(state)
        try:
            json.loads(text)
            valid = text == text.rstrip() and not re.search(r"[eE][+-]?\d{4}", text) \
                and not re.search(r'^[^"]*(?:"[^"]*"[^"]*)*  ', text.replace('\\"', ""))
        except ValueError:
            valid = False
        assert read == valid, text
        agreed += valid
    assert agreed > 100


def test_whitespace_runs_and_number_parts_are_capped():
    """A model that writes spaces or digits forever meets the end of the grammar."""
    assert advance(start(grammar()), b"[\n" + b" " * MAX_INDENT)
    assert not advance(start(grammar()), b"[\n" + b" " * (MAX_INDENT + 1))
    assert advance(start(grammar()), b"[\n" + b"\t" * MAX_INDENT + b"1")
    assert advance(start(grammar()), b"[ 1,")
    for run in (b"  ", b" \n", b"\n\n", b"\t"):
        assert not advance(start(grammar()), b"[" + run)
    assert complete(advance(start(grammar()), b" {}"))    # a SentencePiece reply's space
    for opening in (b"\n{}", b"  {}", b"\t{}"):
        assert not advance(start(grammar()), opening)
    assert complete(advance(start(grammar()), b"9" * MAX_DIGITS))
    assert not advance(start(grammar()), b"9" * (MAX_DIGITS + 1))
    assert complete(advance(start(grammar()), b"0." + b"5" * MAX_DIGITS + b"e-999"))
    assert not advance(start(grammar()), b"1e1234")


def test_a_whole_value_ends_the_text_and_a_number_may_still_grow():
    state = advance(start(grammar()), b'{"a": 12}')
    assert ended(state) and not advance(state, b" ")
    number = advance(start(grammar()), b"12")
    assert complete(number) and not ended(number) and advance(number, b"3")


@pytest.mark.parametrize("end", [b"</think>", b"abab", b"aab", b"a"])
def test_text_until_a_marker_ends_at_its_first_occurrence(end):
    """Any text whose first occurrence of `end` is at its end is read whole; the KMP
    table keeps a partial match across a false start (aab in aaab)."""
    root, rng = Root(Sequence([TextUntil(end), Literal(b"!")])), random.Random(end)
    alphabet = sorted(set(end)) + [ord("x")]
    for _ in range(400):
        text = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        found = text.find(end)
        state = advance(start(root), text + b"!")
        expected = found >= 0 and found + len(end) == len(text)
        assert (bool(state) and complete(state)) == expected, text
