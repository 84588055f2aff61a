"""A chat reply's parts together: a thinking model's reasoning, then its text and tool
calls, whole and streamed at every cut to the same message (the server's two ways of
answering give one reply alike)."""

import json

import pytest

from transduce.data.tool_calls import HERMES, LLAMA3
from transduce.serve.chat_reply import ReplyParts

REASONED_CALL = ('<think>\nThe user wants the weather.\n</think>\n\nLooking it up.\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
                 '</tool_call>')
CASES = [
    (ReplyParts(thinks=True, calls=HERMES), REASONED_CALL,
     ("The user wants the weather.", "Looking it up.",
      [("get_weather", '{"city": "Tokyo"}')])),
    (ReplyParts(thinks=True, inside=True, calls=HERMES),
     REASONED_CALL.removeprefix("<think>\n"),
     ("The user wants the weather.", "Looking it up.",
      [("get_weather", '{"city": "Tokyo"}')])),
    (ReplyParts(thinks=True, calls=HERMES), "<think>\nno call\n</think>\n\nSunny.",
     ("no call", "Sunny.", [])),
    (ReplyParts(calls=LLAMA3), '{"name": "get_time", "parameters": {}}',
     (None, None, [("get_time", "{}")])),
    (ReplyParts(calls=HERMES, parallel=False),
     '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>',
     (None, None, [("a", "{}")])),
    (ReplyParts(), "<tool_call>{}</tool_call>", (None, "<tool_call>{}</tool_call>", [])),
]


@pytest.mark.parametrize("parts,text,expected", CASES)
def test_a_reply_streamed_at_any_cut_is_the_whole_replys_message(parts, text, expected):
    message = parts.message(text)
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls]
    assert (message.reasoning_content, message.content, calls) == expected
    for cut in range(len(text) + 1):
        stream = parts.stream()
        deltas = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        fields = [field for delta in deltas for field in delta]
        if "content" in fields:                                    # reasoning first
            assert "reasoning_content" not in fields[fields.index("content"):]
        joined = {field: "".join(delta.get(field, "") for delta in deltas)
                  for field in ("reasoning_content", "content")}
        streamed = [(call["function"]["name"], call["function"]["arguments"])
                    for delta in deltas for call in delta.get("tool_calls", ())]
        assert joined == {"reasoning_content": message.reasoning_content or "",
                          "content": message.content or ""}
        assert streamed == calls
        indices = [call["index"] for delta in deltas for call in delta.get("tool_calls", ())]
        assert indices == list(range(len(calls)))
        assert stream.finish_reason("stop") == ("tool_calls" if calls else "stop")
        json.dumps(deltas)                                  # each delta is JSON's
