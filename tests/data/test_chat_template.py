"""Chat templates render what transformers renders (its own renderer is the reference),
conversations are checked with errors that name the message and field, and a template
cannot reach Python's internals."""

import pytest

from tests.chat_models import CHATML, CONVERSATIONS, LLAMA3, THINKING, THOUGHT
from transduce.data.chat import Chat, ChatError, ChatTemplate, Message, read_chat_template, \
    template_variables

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
# What the Hub's templates use beyond loops and conditions: namespace(), loop controls,
# tojson with non-ASCII text and options, dict(), the generation block, filters, a
# missing variable.
FEATURES = (
    "{% set ns = namespace(count=0) %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "{% generation %}[{{ ns.count }}:{{ m.role | upper }}] {{ m.content | tojson }}"
    "{% endgeneration %}\n"
    "{% if loop.last %}{{ dict(a=1) | tojson(indent=2, sort_keys=true) }}{% break %}"
    "{% endif %}{% endfor %}"
    "{{ tools is none }}{{ undefined_thing is defined }}{{ eos_token }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def theirs(template, conversation, add_generation_prompt=True, **variables):
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[conversation], chat_template=template,
        add_generation_prompt=add_generation_prompt, **TOKENS, **variables)
    return rendered[0]


@pytest.mark.parametrize("template", [CHATML, LLAMA3, FEATURES], ids=["chatml", "llama3",
                                                                      "features"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_what_transformers_renders(template, conversation, add_generation_prompt):
    ours = ChatTemplate(template, TOKENS).render(Chat.of(conversation), add_generation_prompt)
    assert ours == theirs(template, conversation, add_generation_prompt)
    assert ("ñ" in ours) == any("ñ" in m["content"] for m in conversation)   # not \u00f1


@pytest.mark.parametrize("variables", [{}, {"enable_thinking": False},
                                       {"enable_thinking": True, "unused": [1, {"a": None}]}])
@pytest.mark.parametrize("conversation", [CONVERSATIONS[0], THOUGHT], ids=["one", "thought"])
def test_variables_reach_the_template_as_apply_chat_templates_keywords(variables, conversation):
    """Qwen3's switch: enable_thinking=false opens the reply with an empty reasoning
    block; the history's reasoning is left out either way."""
    ours = ChatTemplate(THINKING, TOKENS).render(Chat.of(conversation, variables=variables))
    assert ours == theirs(THINKING, conversation, **variables)
    assert ours.endswith("<think>\n\n</think>\n\n") == (variables.get("enable_thinking")
                                                        is False)
    assert "Genesis" not in ours and ("God created." in ours) == (conversation is THOUGHT)


@pytest.mark.parametrize("values,message", [
    ([("enable_thinking", False)], "chat_template_kwargs: expected an object"),
    ({"not a name": 1}, "chat_template_kwargs: 'not a name' is not a variable name"),
    ({"messages": []}, "chat_template_kwargs.messages: the template's messages is set by "
                       "the chat itself"),
    ({"add_generation_prompt": False}, "add_generation_prompt: the template's"),
    ({"flag": {1, 2}}, "chat_template_kwargs.flag: a set is no JSON value"),
    ({"flag": {"a": object()}}, "chat_template_kwargs.flag: a dict is no JSON value"),
])
def test_a_variable_a_template_cannot_take_is_named(values, message):
    with pytest.raises(ChatError, match=message):
        template_variables(values)
    with pytest.raises(ChatError, match=message):
        Chat.of(CONVERSATIONS[0], variables=values)


def test_a_variable_of_a_type_the_template_does_not_expect_is_a_chat_error():
    template = ChatTemplate("{% if budget > 2 %}long{% endif %}{{ 1 // zero }}")
    with pytest.raises(ChatError, match="fails on this conversation and its variables: "
                                        "TypeError"):
        template.render(Chat.of(CONVERSATIONS[0], variables={"budget": "a", "zero": 0}))
    with pytest.raises(ChatError, match="ZeroDivisionError"):
        template.render(Chat.of(CONVERSATIONS[0], variables={"budget": 3, "zero": 0}))


def test_a_variable_may_not_replace_a_special_token():
    with pytest.raises(ChatError, match="chat_template_kwargs.eos_token: the template's "
                                        "eos_token is the model's special token"):
        ChatTemplate(THINKING, TOKENS).render(Chat.of(CONVERSATIONS[0],
                                                      variables={"eos_token": "x"}))


def test_a_refusal_of_the_template_is_a_chat_error_with_its_words():
    conversation = Chat.of([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatError, match="refuses this conversation: Conversation roles must "
                                        "alternate"):
        ChatTemplate(LLAMA3, TOKENS).render(conversation)


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{{ messages.append(1) }}",
])
def test_a_template_cannot_reach_pythons_internals_or_change_the_messages(template):
    conversation = Chat.of([{"role": "user", "content": "a"}])
    with pytest.raises(ChatError, match="refuses"):
        ChatTemplate(template).render(conversation)


def test_a_template_jinja_cannot_compile_is_named():
    with pytest.raises(ChatError, match="config.json: not a Jinja template"):
        ChatTemplate("{% for m in messages %}").check("config.json")


@pytest.mark.parametrize("messages,message", [
    ("hello", "messages: expected a list of messages"),
    ({"role": "user", "content": "a"}, "messages: expected a list of messages"),
    ([], "messages: no messages"),
    (["hello"], r"messages\[0\]: expected an object"),
    ([{"content": "a"}], r"messages\[0\].role: expected a non-empty string"),
    ([{"role": "", "content": "a"}], r"messages\[0\].role: expected a non-empty string"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": None}],
     r"messages\[1\].content: expected a string"),
    ([{"role": "user", "content": "a\ud800"}], r"messages\[0\].content: a lone surrogate at "
                                               r"character 2"),
])
def test_a_malformed_conversation_is_refused_naming_the_message(messages, message):
    with pytest.raises(ChatError, match=message):
        Chat.of(messages)


def test_messages_may_be_given_as_objects_or_messages_alike():
    given = [{"role": "system", "content": "s"}, Message("user", "u")]
    assert Chat.of(given).messages == (Message("system", "s"), Message("user", "u"))
    assert Chat.of(Chat.of(given)) == Chat.of(given)


def test_a_list_of_named_templates_gives_the_default_one():
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert read_chat_template(named, "tokenizer_config.json") == "D"
    assert read_chat_template(None, "tokenizer_config.json") is None
    with pytest.raises(ChatError, match=r"tokenizer_config.json: chat_template lists "
                                        r"\['tool_use'\] but no \"default\""):
        read_chat_template(named[:1], "tokenizer_config.json")
    with pytest.raises(ChatError, match="must be a string or a list"):
        read_chat_template(3, "tokenizer_config.json")


def test_a_template_survives_its_record():
    template = ChatTemplate(CHATML, TOKENS)
    assert ChatTemplate.from_dict(template.to_dict(), "x") == template
    for bad in ({"tokens": {}}, {"template": "t", "tokens": {"bos_token": 1}}, "t"):
        with pytest.raises(ChatError, match="x"):
            ChatTemplate.from_dict(bad, "x")
