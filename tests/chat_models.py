"""Instruct models for the chat tests: a random Llama saved by transformers with a
tokenizer that knows ChatML's or Llama 3's turn tokens, and a chat template in
tokenizer_config.json as the Hub's instruct models ship it."""

import json
from types import SimpleNamespace

import pytest
import torch

from tests.test_import_llama import TRAINING_TEXT, hf_checkpoint, write_spm_bpe

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

# Qwen2's and SmolLM2's layout: a system message first if given, no bos.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama 3's layout: bos first, headers around each role, turns that must alternate.
LLAMA3 = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system = none %}{% endif %}"
    "{% if system is not none %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' + system | trim + '<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# ChatML with a thinking switch, as Qwen3's template has it: an assistant turn of the
# history keeps only what follows its reasoning, and enable_thinking=false opens the
# reply with an empty reasoning block.
THINKING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")
# A template that opens the reply's reasoning itself (DeepSeek-R1's and QwQ's way) and
# writes an earlier reply's reasoning back from its reasoning_content (Qwen3's way).
OPENS_REASONING = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.reasoning_content is string %}"
    "{{ '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")
THINK_TOKENS = ["<think>", "</think>"]     # Qwen3's: tokens of their own, not special
THOUGHT = [{"role": "user", "content": "In the beginning"},
           {"role": "assistant", "content": "<think>\nGenesis.\n</think>\n\nGod created."},
           {"role": "user", "content": "El niño"}]

EOS, STEPS = 2, 12      # the tokenizer's eos; reply tokens the tests generate
TURN_TOKENS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|eot_id|>"]
CONFIG = dict(hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello world!"}],
    [{"role": "system", "content": "Answer in Spanish."},
     {"role": "user", "content": "In the beginning"}],
    [{"role": "user", "content": "El niño comió una manzana."},
     {"role": "assistant", "content": "¿verdad que sí?"},
     {"role": "user", "content": "Ça coûte 12,50 €"}],
]


def instruct_llama(directory, template, seed=0, plain_tokens=(), write=write_spm_bpe,
                   special_tokens=(), **config):
    """A random LlamaForCausalLM in `directory` whose tokenizer (`write` writes it) has
    the turn tokens and `special_tokens` (and `plain_tokens`, added as tokens of their
    own but not special) and whose tokenizer_config.json holds `template` -> the
    transformers model."""
    vocabulary = directory / "vocabulary"
    vocabulary.mkdir(parents=True)
    write(vocabulary)
    backend = tokenizers.Tokenizer.from_file(str(vocabulary / "tokenizer.json"))
    backend.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)
                                for token in [*TURN_TOKENS, *special_tokens]])
    backend.add_tokens([tokenizers.AddedToken(token, special=False, normalized=False)
                        for token in plain_tokens])
    backend.save(str(vocabulary / "tokenizer.json"))
    settings = json.loads((vocabulary / "tokenizer_config.json").read_text())
    (vocabulary / "tokenizer_config.json").write_text(json.dumps(
        {**settings, "chat_template": template}))
    return hf_checkpoint(directory / "hf", vocabulary, seed=seed, **{**CONFIG, **config})


def template_ids(hf_dir, conversation, **variables):
    """transformers' apply_chat_template ids, opening the assistant's turn; `variables`
    are its keyword arguments for the template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                        tokenize=True, **variables)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_reply(hf, ids, steps, eos):
    """transformers' greedy reply tokens after `ids`, stopping at any of `eos`."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                          eos_token_id=list(eos), pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def chatml_model(root):
    """A ChatML model imported from `root`/hf, whose generation_config.json lists an end
    token besides eos: a token that its greedy reply to the first conversation makes
    third, or later (`cut`: the reply's length there)."""
    from transduce.decode.generate import Generator
    from transduce.importers import import_llama

    hf = instruct_llama(root, CHATML)
    hf_dir = root / "hf"
    reply = greedy_reply(hf, template_ids(hf_dir, CONVERSATIONS[0]), STEPS, [EOS])
    cut = next(k for k in range(2, STEPS) if reply[k] not in reply[:k])
    settings = json.loads((hf_dir / "generation_config.json").read_text())
    (hf_dir / "generation_config.json").write_text(json.dumps(
        {**settings, "eos_token_id": [EOS, reply[cut]]}))
    out = import_llama(hf_dir, root / "ours")
    return SimpleNamespace(hf=hf, hf_dir=hf_dir, out=out, end=reply[cut], cut=cut,
                           generator=Generator.load(out))


def thinking_model(root):
    """An instruct Llama imported from `root`/hf whose template has Qwen3's thinking
    switch (THINKING)."""
    from transduce.decode.generate import Generator
    from transduce.importers import import_llama

    hf = instruct_llama(root, THINKING, seed=2)
    out = import_llama(root / "hf", root / "ours")
    return SimpleNamespace(hf=hf, hf_dir=root / "hf", out=out, generator=Generator.load(out))


def reasoning_model(root):
    """An instruct Llama imported from `root`/hf whose vocabulary has <think> and
    </think> and whose template opens the reply's reasoning (OPENS_REASONING)."""
    from transduce.decode.generate import Generator
    from transduce.importers import import_llama

    hf = instruct_llama(root, OPENS_REASONING, seed=3, plain_tokens=THINK_TOKENS)
    out = import_llama(root / "hf", root / "ours")
    return SimpleNamespace(hf=hf, hf_dir=root / "hf", out=out, generator=Generator.load(out))


# A template that takes tools as Qwen2.5's and Hermes' do: listed in the system turn as
# JSON, earlier calls written back as <tool_call> blocks with their arguments' JSON,
# tools' results as <tool_response> turns of the user's.
HERMES_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' + tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
    "</tool_call><|im_end|>\n' }}"
    "{% elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{{ '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}"
    "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response>"
    "<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]          # Qwen2.5's: not special
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city now.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object"}}}]
ASKS = [{"role": "user", "content": "the weather in Tokyo"}]
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
GREETS = [{"role": "user", "content": "Hello world!"}]
GREETING = "The dog"


def write_byte_bpe(directory):
    """A byte-level BPE (Qwen's kind: any text round-trips, JSON's too) trained here on
    the tool tests' texts, <unk> <s> </s> its first ids as write_spm_bpe's."""
    trained = tokenizers.ByteLevelBPETokenizer()
    texts = [*TRAINING_TEXT, CALLS, GREETING, json.dumps(TOOLS), ASKS[0]["content"]]
    trained.train_from_iterator(texts * 2, vocab_size=500, min_frequency=1,
                                special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return directory


def tool_model(root, steps=120):
    """An instruct Llama imported from `root`/hf whose template takes tools (HERMES_TOOLS)
    and whose weights were trained here until its greedy reply to ASKS, given TOOLS, is
    CALLS, and to GREETS is GREETING: a model that calls tools when asked."""
    from transduce.decode.generate import Generator
    from transduce.importers import import_llama

    hf = instruct_llama(root, HERMES_TOOLS, seed=4, plain_tokens=TOOL_TOKENS,
                        write=write_byte_bpe, max_position_embeddings=512)
    hf_dir = root / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    examples = [(template_ids(hf_dir, conversation, tools=TOOLS),
                 tokenizer(reply, add_special_tokens=False)["input_ids"] + [EOS])
                for conversation, reply in ((ASKS, CALLS), (GREETS, GREETING))]
    optimizer = torch.optim.Adam(hf.parameters(), lr=1e-2)
    hf.train()
    for _ in range(steps):
        optimizer.zero_grad()
        for prompt, reply in examples:
            ids = torch.tensor([prompt + reply])
            labels = torch.tensor([[-100] * len(prompt) + reply])
            hf(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    hf.eval()
    for prompt, reply in examples:
        assert greedy_reply(hf, prompt, len(reply) + 2, [EOS]) == reply, "not learnt"
    hf.save_pretrained(hf_dir)
    out = import_llama(hf_dir, root / "ours")
    return SimpleNamespace(hf=hf, hf_dir=hf_dir, out=out, generator=Generator.load(out))


# Mistral's ways of taking tools: v3 tokenizers' templates write a reply's calls as
# [TOOL_CALLS] and a JSON list, v11's as [TOOL_CALLS]name[ARGS]{...} each; both markers
# are special tokens.
MISTRAL_TOOLS = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.role == 'user' %}"
    "{{ '[INST]' + message.content + '[/INST]' }}{% elif message.tool_calls %}"
    "{{ '[TOOL_CALLS]' + message.tool_calls | map(attribute='function') | list | tojson }}"
    "{% else %}{{ message.content }}{% endif %}{% endfor %}")
MISTRAL_ARGS_TOOLS = MISTRAL_TOOLS.replace(
    "{{ '[TOOL_CALLS]' + message.tool_calls | map(attribute='function') | list | tojson }}",
    "{% for call in message.tool_calls %}{{ '[TOOL_CALLS]' + call.function.name + '[ARGS]'"
    " + call.function.arguments }}{% endfor %}")


def mistral_tool_model(root, template):
    """A random instruct Llama imported from `root`/hf whose template takes tools
    Mistral's way (`template`: MISTRAL_TOOLS or MISTRAL_ARGS_TOOLS), [TOOL_CALLS] and
    [ARGS] special tokens of its vocabulary."""
    from transduce.decode.generate import Generator
    from transduce.importers import import_llama

    hf = instruct_llama(root, template, seed=5, write=write_byte_bpe,
                        special_tokens=["[TOOL_CALLS]", "[ARGS]"], max_position_embeddings=512)
    out = import_llama(root / "hf", root / "ours")
    return SimpleNamespace(hf=hf, hf_dir=root / "hf", out=out, generator=Generator.load(out))
