"""Conversations as an instruct model reads them.

A chat model was fine-tuned on conversations laid out in its own way (ChatML's
`<|im_start|>user ... <|im_end|>`, Llama 3's `<|start_header_id|>user<|end_header_id|>`,
...); Hugging Face ships that layout as a Jinja template in tokenizer_config.json
("chat_template") or chat_template.jinja, and an import keeps it with the tokenizer
(HFTokenizer.chat_template, recorded in the checkpoint's "tokenizer" section).

A `Chat` is a prompt of its own: Generator.encode renders it with the template, with the
opening of the assistant's turn after the last message (add_generation_prompt), and
reads the text without adding bos (a template writes bos itself where its model wants
it). Templates run as transformers runs them, so that the ids are the ones the model was
fine-tuned on: a sandboxed Jinja environment that trims blocks, with loop controls,
`raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII characters, and
the special tokens' strings (bos_token, eos_token, ...) as variables. A Chat may carry
variables of its own for the template, as apply_chat_template's keyword arguments do
(Qwen3's enable_thinking=False, say).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Mapping

from transduce.data.tool_calls import ToolCall
from transduce.errors import TransduceError


class ChatError(TransduceError, ValueError):
    """A conversation that cannot be laid out: a malformed message, or one its template
    refuses (most refuse roles that do not alternate); names which."""


@dataclass(frozen=True)
class Message:
    role: str          # "system", "user", "assistant", "tool" (a template may take others)
    content: str | None  # None only for an assistant's turn of tool calls alone
    # An earlier reply's reasoning, as an API answer gave it apart from its content
    # (data/reasoning.py); a thinking model's template may write it back (Qwen3's).
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()   # an assistant's calls (data/tool_calls.py)
    tool_call_id: str | None = None         # a tool's result: the call it answers
    name: str | None = None                 # a tool's result: the function's name

    def template_fields(self) -> dict[str, Any]:
        """The message as templates read it, transformers' way: a call's arguments an
        object (templates write them with tojson), fields that are not given left out."""
        fields: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            fields["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            fields["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": json.loads(call.arguments)}}
                for call in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                fields[key] = getattr(self, key)
        return fields


# What every render sets itself: a template variable of a Chat may not take these names
# (nor those of the template's special tokens).
RENDER_NAMES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


@dataclass(frozen=True)
class Chat:
    """A conversation to answer: its messages, oldest first, the last one the user's (or
    a system message alone), and variables its template reads besides them (checked by
    template_variables)."""

    messages: tuple[Message, ...]
    variables: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # Functions the model may call, as OpenAI's API gives them ({"type": "function",
    # "function": {"name", "description", "parameters"}}), for the template's `tools`.
    tools: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)

    @classmethod
    def of(cls, messages: Iterable[Mapping[str, Any] | Message] | "Chat",
           where: str = "messages", variables: Mapping[str, Any] | None = None,
           tools: Iterable[Mapping[str, Any]] | None = None) -> Chat:
        """A Chat of {"role": ..., "content": ...} objects (or Messages); a malformed one
        is a ChatError naming it as `where`[i]. variables, tools: the template's,
        replacing a given Chat's."""
        if isinstance(messages, Chat):
            return cls(messages.messages, messages.variables if variables is None
                       else template_variables(variables),
                       messages.tools if tools is None else _tools(tools))
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
            raise ChatError(f"{where}: expected a list of messages ({{\"role\": ..., "
                            f"\"content\": ...}}), got a {type(messages).__name__}")
        checked = tuple(_message(message, f"{where}[{index}]")
                        for index, message in enumerate(messages))
        if not checked:
            raise ChatError(f"{where}: no messages")
        return cls(checked, template_variables(variables or {}), _tools(tools or ()))


def _tools(tools: Iterable[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    """Tools as OpenAI's API gives them, each an object of JSON values; else a
    ChatError naming tools[i]."""
    if isinstance(tools, (str, bytes, Mapping)):
        raise ChatError("tools: expected a list of {\"type\": \"function\", \"function\": "
                        "...} objects")
    tools = tuple(tools)
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not _json_like(tool):
            raise ChatError(f"tools[{index}]: expected an object of JSON values")
    return tools


def template_variables(values: Any, where: str = "chat_template_kwargs",
                       tokens: Iterable[str] = ()) -> dict[str, Any]:
    """Variables for a chat template, checked: an object whose names are identifiers
    other than those a render sets (RENDER_NAMES) and the template's special `tokens`,
    each value JSON's (text, a number, a boolean, null, a list or an object of them);
    else a ChatError naming `where`."""
    if not isinstance(values, Mapping):
        raise ChatError(f"{where}: expected an object of template variables, got a "
                        f"{type(values).__name__}")
    for name, value in values.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ChatError(f"{where}: {name!r:.40} is not a variable name")
        if name in RENDER_NAMES:
            raise ChatError(f"{where}.{name}: the template's {name} is set by the chat itself")
        if name in tokens:
            raise ChatError(f"{where}.{name}: the template's {name} is the model's special "
                            f"token")
        if not _json_like(value):
            raise ChatError(f"{where}.{name}: a {type(value).__name__} is no JSON value")
    return dict(values)


def _json_like(value: Any) -> bool:
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_like(item) for item in value)
    return isinstance(value, Mapping) and all(isinstance(key, str) and _json_like(item)
                                              for key, item in value.items())


def _message(message: Any, where: str) -> Message:
    if isinstance(message, Message):
        message = message.template_fields()
    if not isinstance(message, Mapping):
        raise ChatError(f"{where}: expected an object with \"role\" and \"content\", got a "
                        f"{type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ChatError(f"{where}.role: expected a non-empty string, got {role!r:.40}")
    calls = tuple(_tool_call(call, f"{where}.tool_calls[{index}]")
                  for index, call in enumerate(message.get("tool_calls") or ()))
    if content is not None or not calls:
        _check_text(content, f"{where}.content")
    texts = {key: message.get(key) for key in ("reasoning_content", "tool_call_id", "name")}
    for key, text in texts.items():
        if text is not None:
            _check_text(text, f"{where}.{key}")
    return Message(role, content, tool_calls=calls, **texts)


def _tool_call(call: Any, where: str) -> ToolCall:
    """OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}, the
    arguments a JSON object's text (or the object, as transformers takes it)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise ChatError(f"{where}: expected {{\"id\": ..., \"type\": \"function\", "
                        f"\"function\": {{\"name\": ..., \"arguments\": ...}}}}")
    _check_text(call.get("id", ""), f"{where}.id")
    _check_text(function.get("name"), f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise ChatError(f"{where}.function.arguments: not JSON ({error})") from None
    if not isinstance(arguments, Mapping) or not _json_like(arguments):
        raise ChatError(f"{where}.function.arguments: expected a JSON object's text")
    return ToolCall(call.get("id", ""), function["name"],
                    json.dumps(arguments, ensure_ascii=False))


def _check_text(text: Any, where: str) -> None:
    if not isinstance(text, str):
        raise ChatError(f"{where}: expected a string, got {text!r:.40}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ChatError(f"{where}: a lone surrogate at character {error.start + 1}, which "
                        f"is no text") from None


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template and the special tokens' strings it may read (bos_token,
    eos_token, ...: tokenizer_config.json's, as transformers passes them)."""

    template: str
    tokens: Mapping[str, str] = field(default_factory=dict)

    def render(self, chat: Chat, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's text; with add_generation_prompt, followed by
        the opening of the assistant's turn, so that the model writes the reply."""
        import jinja2

        messages = [message.template_fields() for message in chat.messages]
        template_variables(chat.variables, tokens=self.tokens)
        try:
            return _compiled(self.template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                tools=[dict(tool) for tool in chat.tools] or None, documents=None,
                **self.tokens, **chat.variables)
        except jinja2.TemplateError as error:
            raise ChatError(f"the model's chat template refuses this conversation: "
                            f"{error}") from None
        except (TypeError, ValueError, ArithmeticError, LookupError) as error:
            # a variable of a type the template does not expect ("a" > 2)
            raise ChatError(f"the model's chat template fails on this conversation and its "
                            f"variables: {type(error).__name__}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"template": self.template, "tokens": dict(self.tokens)}

    @classmethod
    def from_dict(cls, value: Any, where: str) -> ChatTemplate:
        """What to_dict wrote; anything else is a ChatError naming `where`."""
        if not isinstance(value, dict) or not isinstance(value.get("template"), str):
            raise ChatError(f"{where} must be an object with a string \"template\"")
        tokens = value.get("tokens", {})
        if not isinstance(tokens, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()):
            raise ChatError(f"{where}.tokens must map names to strings")
        template = cls(value["template"], tokens)
        template.check(where)
        return template

    def check(self, where: str) -> None:
        """A template Jinja cannot compile is a ChatError naming `where`."""
        import jinja2

        try:
            _compiled(self.template)
        except jinja2.TemplateError as error:
            raise ChatError(f"{where}: not a Jinja template ({error})") from None


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in a sandbox: a checkpoint's template is code from
    elsewhere, so it reads no attributes of Python's internals."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _generation_block()])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda form: datetime.now().strftime(form)
    return environment.from_string(template)


def _generation_block():
    """The {% generation %} ... {% endgeneration %} block some templates wrap assistant
    turns in (transformers marks the tokens it must learn with it): here, its text as is."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_text"), [], [], body
                                          ).set_lineno(line)

        @staticmethod
        def _text(caller) -> str:
            return caller()

    return GenerationBlock


def read_chat_template(value: Any, where: str) -> str | None:
    """tokenizer_config.json's "chat_template": a string, or a list of named templates
    ({"name": ..., "template": ...}), of which the one named "default" is the chat's;
    None where there is none."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        named = {item.get("name"): item.get("template") for item in value}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatError(f"{where}: chat_template lists {sorted(map(str, named))} but no "
                        f"\"default\" one")
    raise ChatError(f"{where}: chat_template must be a string or a list of named templates")
