"""A thinking model's reply split into its reasoning and its answer: whole, as its
template would write it back (no newlines around the reasoning, none opening the
answer), and streamed, a piece at a time, to the same two parts whatever the pieces."""

import json
import random
from types import SimpleNamespace

import pytest

from transduce.data.chat import ChatTemplate
from transduce.data.reasoning import ReasoningMarkers, ReasoningStream, reasoning_grammar, \
    reasoning_markers, split_reasoning

# (reply, whether the prompt opened the reasoning) -> (reasoning, answer)
CASES = [
    (("<think>\nI count.\n</think>\n\nThree.", False), ("I count.", "Three.")),
    (("<think>\n\n</think>\n\nThree.", False), ("", "Three.")),
    (("  \n<think>a\nb</think>c\n", False), ("a\nb", "c\n")),
    (("Three.", False), (None, "Three.")),
    (("Three. <think>no</think>", False), (None, "Three. <think>no</think>")),
    (("  Three.", False), (None, "  Three.")),
    (("<thin", False), (None, "<thin")),
    (("", False), (None, "")),
    (("<think>\nstill counting", False), ("still counting", "")),     # cut off
    (("I count.\n</think>\n\nThree.", True), ("I count.", "Three.")),
    (("I count. </think> a </think> b", True), ("I count. ", " a </think> b")),
    (("I count<", True), ("I count<", "")),
    (("\n", True), ("", "")),
]


@pytest.mark.parametrize("given,expected", CASES)
def test_a_whole_reply_splits_as_its_template_writes_it_back(given, expected):
    assert split_reasoning(*given) == expected


def streamed(text, inside, cuts):
    """The deltas of a ReasoningStream fed `text` cut at `cuts`, finished."""
    stream = ReasoningStream(inside)
    bounds = [0, *cuts, len(text)]
    deltas = [delta for start, end in zip(bounds, bounds[1:])
              for delta in stream.feed(text[start:end])]
    return deltas + stream.finish()


def joined(deltas):
    """The two parts the deltas make; reasoning never follows the answer's first text."""
    fields = [field for field, _ in deltas]
    if "content" in fields:
        assert "reasoning_content" not in fields[fields.index("content"):]
    return tuple("".join(part for f, part in deltas if f == field)
                 for field in ("reasoning_content", "content"))


@pytest.mark.parametrize("given,expected", CASES)
def test_a_streamed_reply_gives_the_same_parts_whatever_its_pieces(given, expected):
    text, inside = given
    whole = (expected[0] or "", expected[1])
    for cut in range(len(text) + 1):                         # two pieces, every cut
        assert joined(streamed(text, inside, [cut])) == whole
    assert joined(streamed(text, inside, range(1, len(text)))) == whole   # a character each
    generator = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(generator.sample(range(len(text) + 1), min(3, len(text) + 1)))
        assert joined(streamed(text, inside, cuts)) == whole


def test_a_stream_holds_back_only_what_more_text_could_change():
    stream = ReasoningStream()
    assert stream.feed(" ") == [] and stream.feed("<thi") == []    # may open a block
    assert stream.feed("nk>\nI count") == [("reasoning_content", "I count")]
    assert stream.feed(".\n</th") == [("reasoning_content", ".")]  # may close it
    assert stream.feed("ink>\n") == []                               # the answer's newline
    assert stream.feed("\nThree") == [("content", "Three")]
    assert stream.finish() == []
    plain = ReasoningStream()
    assert plain.feed("Three") == [("content", "Three")]


def test_the_prompt_opens_the_reasoning_when_its_last_marker_opens():
    markers = ReasoningMarkers(open_id=7, close_id=8)
    assert markers.starts_inside([1, 2, 7, 3])
    assert not markers.starts_inside([1, 7, 3, 8, 4])             # enable_thinking=false
    assert not markers.starts_inside([1, 2, 3])


def test_a_thinking_model_has_both_markers_as_tokens_and_in_its_template():
    vocabulary = {"<think>": 5, "</think>": 6}
    backend = SimpleNamespace(token_to_id=vocabulary.get)
    template = ChatTemplate("{{ messages[0]['content'] }}{{ '</think>' }}")

    def tokenizer(template, backend=backend):
        return SimpleNamespace(chat_template=template, backend=backend)
    assert reasoning_markers(tokenizer(template)) == ReasoningMarkers(5, 6)
    assert reasoning_markers(tokenizer(ChatTemplate("{{ messages }}"))) is None
    assert reasoning_markers(tokenizer(None)) is None
    lacking = SimpleNamespace(token_to_id={"<think>": 5}.get)
    assert reasoning_markers(tokenizer(template, lacking)) is None
    assert reasoning_markers(SimpleNamespace()) is None          # SentencePiece's, no chat


@pytest.mark.parametrize("inside, reply, read", [
    (False, '<think>\nI count {1 < 2}.\n</think>\n\n{"n": 3}', True),
    (False, '<think></think>{"n": 3}', True),
    (False, '{"n": 3}', True),
    (False, ' {"n": 3}', True),
    (False, "Three.", False),
    (False, '<think>\nI count.\n</think>\n\nThree.', False),
    (False, '<think>a</think></think>{"n": 3}', False),     # the first marker ends it
    (False, '<think>a</think>\n\n\n\n\n\n\n\n\n{"n": 3}', False),   # 9 blank bytes
    (True, 'I count </thin k.</think>\n\n{"n": 3}', True),
    (True, '</think>{"n": 3}', True),
    (True, '{"n": 3}', False),                              # still reasoning
    (True, "I count.</think> Three.", False),
])
def test_a_reply_grammar_lets_reasoning_be_and_keeps_what_follows(inside, reply, read):
    from transduce.decode.json_grammar import advance, complete, ended, start
    from transduce.decode.reply_grammar import compile_grammar

    grammar = reasoning_grammar(json.dumps({"json": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}),
        inside)
    state = advance(start(compile_grammar(json.loads(grammar))), reply.encode())
    assert (bool(state) and complete(state)) == read
    if read:
        assert ended(state)
        reasoning, answer = split_reasoning(reply, inside)
        assert json.loads(answer) == {"n": 3}
