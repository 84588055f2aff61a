"""A reply's tool calls read out of its text, in each family's way of writing them:
whole, with the text around them apart; a reply whose calls do not parse kept whole as
text; streamed, a piece at a time, to the same text and calls whatever the pieces."""

import json
import random

import pytest

from transduce.data.tool_calls import HERMES, LLAMA3, MISTRAL, MISTRAL_WITH_ARGS, ToolCallStream, \
    call_format, split_tool_calls, takes_tools

WEATHER = ("get_weather", '{"city": "Tokyo"}')
TIME = ("get_time", "{}")
NESTED = ("plot", '{"points": [[1, 2], [3, 4]], "style": {"color": "red", "note": "a}b"}}')

# (format, reply) -> (content, [(name, arguments)])
CASES = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
             '</tool_call>', (None, [WEATHER])),
    (HERMES, 'I will look.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Tokyo"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
             '"arguments": {}}\n</tool_call>\n', ("I will look.", [WEATHER, TIME])),
    (HERMES, '<tool_call>{"name": "plot", "arguments": {"points": [[1, 2], [3, 4]], '
             '"style": {"color": "red", "note": "a}b"}}}</tool_call>', (None, [NESTED])),
    (HERMES, '<tool_call>\n{"name": "get_time", "parameters": {}}', (None, [TIME])),
    (HERMES, '<tool_call>\n{"name": "get_time"}\n</tool_call>', (None, [TIME])),
    (HERMES, 'First <tool_call>{"name": "get_time"}</tool_call> then\n', ("First  then",
                                                                          [TIME])),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "To',
     ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "To', [])),    # cut off
    (HERMES, '<tool_call>\n{"arguments": {}}\n</tool_call>',
     ('<tool_call>\n{"arguments": {}}\n</tool_call>', [])),                     # no name
    (HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    (HERMES, "Tokyo is sunny.", ("Tokyo is sunny.", [])),
    (HERMES, "a <tool_ca", ("a <tool_ca", [])),
    (HERMES, "", (None, [])),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Tokyo"}}', (None, [WEATHER])),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Tokyo"}}; '
             '{"name": "get_time", "parameters": {}}', (None, [WEATHER, TIME])),
    (LLAMA3, ' {"name": "get_time", "arguments": "{}"}', (None, [TIME])),
    (LLAMA3, '{"city": "Tokyo"}', ('{"city": "Tokyo"}', [])),
    (LLAMA3, '{"name": "get_time", "parameters": {}} and more',
     ('{"name": "get_time", "parameters": {}} and more', [])),
    (LLAMA3, "It is {sunny}.", ("It is {sunny}.", [])),
    (LLAMA3, "<|python", ("<|python", [])),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo"}}, '
              '{"name": "get_time", "arguments": {}}]', (None, [WEATHER, TIME])),
    (MISTRAL, 'Looking. [TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo"}'
              '[TOOL_CALLS]get_time[ARGS]{}', ("Looking.", [WEATHER, TIME])),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather"', ('[TOOL_CALLS][{"name": "get_weather"',
                                                      [])),
    (MISTRAL, "[TOOL_CALLS]get_time[ARGS]{} {}", ("[TOOL_CALLS]get_time[ARGS]{} {}", [])),
    (MISTRAL, "No call [TOOL", ("No call [TOOL", [])),
]
IDS = [f"{form.name}-{k}" for k, (form, _, _) in enumerate(CASES)]


def _calls(calls):
    return [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("form,reply,expected", CASES, ids=IDS)
def test_a_whole_replys_calls_come_apart_from_its_text(form, reply, expected):
    content, calls = split_tool_calls(reply, form)
    assert (content, _calls(calls)) == expected
    for call in calls:
        assert json.loads(call.arguments) == json.loads(dict([WEATHER, TIME, NESTED])[call.name])


def test_each_call_has_an_id_of_its_own_of_its_familys_length():
    _, calls = split_tool_calls('<tool_call>{"name": "f"}</tool_call>' * 50, HERMES)
    assert len({call.id for call in calls}) == 50
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in calls)
    _, (call,) = split_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}]', MISTRAL)
    assert len(call.id) == 9 and call.id.isalnum()    # Mistral's templates refuse others


def streamed(form, text, cuts):
    stream = ToolCallStream(form)
    bounds = [0, *cuts, len(text)]
    deltas = [delta for start, end in zip(bounds, bounds[1:])
              for delta in stream.feed(text[start:end])]
    ending = stream.finish()
    assert all(field == "content" for field, _ in deltas)   # calls come once whole
    return deltas + ending


def joined(deltas):
    content = "".join(value for field, value in deltas if field == "content")
    return content, _calls(value for field, value in deltas if field == "tool_call")


@pytest.mark.parametrize("form,reply,expected", CASES, ids=IDS)
def test_a_streamed_reply_gives_the_same_text_and_calls_whatever_its_pieces(form, reply,
                                                                            expected):
    whole = (expected[0] or "", expected[1])
    for cut in range(len(reply) + 1):
        assert joined(streamed(form, reply, [cut])) == whole
    assert joined(streamed(form, reply, range(1, len(reply)))) == whole
    draw = random.Random(len(reply))
    for _ in range(20):
        cuts = sorted(draw.sample(range(len(reply) + 1), min(4, len(reply) + 1)))
        assert joined(streamed(form, reply, cuts)) == whole


def test_streamed_text_never_shows_a_calls_marker():
    reply = CASES[1][1]
    for cut in range(len(reply) + 1):
        for field, value in streamed(HERMES, reply, [cut]):
            assert field != "content" or "<" not in value


@pytest.mark.parametrize("template,form", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
     "{{ '<tool_call>\\n' + call.name }}", HERMES),                      # Qwen2.5's way
    ("{% if tools %}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
     "{{- '\"parameters\": ' }}{% endif %}", LLAMA3),                     # Llama 3.1's
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "{{ '[TOOL_CALLS]' }}", MISTRAL),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", MISTRAL_WITH_ARGS),
    ("{% for message in messages %}{{ message.content }}{% endfor %}", None),
])
def test_a_templates_way_of_writing_calls_is_recognised(template, form):
    assert call_format(template) is form
    assert takes_tools(template) == (form is not None)


FUNCTIONS = [
    {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "maxLength": 40},          # kept when forced too
            "unit": {"$ref": "#/$defs/Unit"}},
        "$defs": {"Unit": {"enum": ["C", "F"]}}}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    {"name": "ping"}]


@pytest.mark.parametrize("form", [HERMES, LLAMA3, MISTRAL, MISTRAL_WITH_ARGS],
                         ids=["hermes", "llama3", "mistral", "mistral-args"])
@pytest.mark.parametrize("most", [1, 2, None])
def test_a_forced_reply_is_calls_of_the_functions_each_an_instance(form, most):
    """Random texts of the forced grammar split into 1 to `most` calls, each of a given
    function, its arguments an instance of its parameters (their own $refs resolved)."""
    jsonschema = pytest.importorskip("jsonschema")
    from tests.decode.test_json_schema import walk
    from transduce.decode.reply_grammar import compile_grammar

    root = compile_grammar(form.forced(FUNCTIONS, most))
    parameters = {f["name"]: f.get("parameters", {"type": "object"}) for f in FUNCTIONS}
    rng, counts = random.Random(form.name), set()
    for _ in range(25):
        text = walk(root, rng)
        content, calls = split_tool_calls(text, form)
        assert content is None and 1 <= len(calls) <= (most or 99), text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), parameters[call.name])
        counts.add(len(calls))
    assert most == 1 or len(counts) > 1


def test_a_forced_hermes_call_is_written_as_the_templates_write_one():
    from transduce.decode.json_grammar import advance, complete, ended, start
    from transduce.decode.reply_grammar import compile_grammar

    one = compile_grammar(HERMES.forced(FUNCTIONS[1:2], 1))
    text = b'<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert ended(advance(start(one), text))
    many = compile_grammar(HERMES.forced(FUNCTIONS, None))
    state = advance(start(many), text + b"\n" + text)
    assert complete(state) and not ended(state)        # another call, or the end
    assert not advance(start(one), text.replace(b"get_time", b"get_weather"))
