"""An instruct model's conversations: the import keeps its chat template and end tokens,
a Chat is the ids transformers' apply_chat_template gives, the reply is transformers'
greedy reply (ending at any end token), and the template goes with every copy of the
model: a fine-tuning's saves, averages, the ONNX export and the export to transformers.
`transduce chat` holds a conversation; `generate --chat` answers one message a line."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from tests.chat_models import CHATML, CONVERSATIONS, EOS, LLAMA3, STEPS, THOUGHT, \
    chatml_model, greedy_reply, instruct_llama, template_ids, thinking_model, transformers
from tests.test_import_llama import hf_checkpoint, write_spm_bpe
from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.chat import Chat
from transduce.decode.generate import Generator
from transduce.decode.search import beam_search, best_extensions
from transduce.importers import ForeignCheckpointError, import_llama
from transduce.model import load_model

@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return chatml_model(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3")
    hf = instruct_llama(root, LLAMA3, seed=1)
    out = import_llama(root / "hf", root / "ours")
    return SimpleNamespace(hf=hf, hf_dir=root / "hf", out=out, generator=Generator.load(out))


def section(path):
    return json.loads((path / "config.json").read_text())["tokenizer"]


def test_the_import_records_the_template_its_tokens_and_the_end_tokens(chatml):
    recorded = section(chatml.out)
    assert recorded["chat_template"]["template"] == CHATML
    assert recorded["chat_template"]["tokens"] == {"bos_token": "<s>", "eos_token": "</s>",
                                                   "unk_token": "<unk>"}
    assert recorded["stop_ids"] == [chatml.end]
    assert chatml.generator.end_ids == (EOS, chatml.end)


@pytest.mark.parametrize("model", ["chatml", "llama3"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_a_conversation_is_the_ids_apply_chat_template_gives(model, index, request):
    imported = request.getfixturevalue(model)
    conversation = CONVERSATIONS[index]
    (ids,) = imported.generator.encode([Chat.of(conversation)])
    assert ids == template_ids(imported.hf_dir, conversation)
    assert (ids[0] == 1) == (model == "llama3")       # bos only where the template writes it


@pytest.mark.parametrize("model", ["chatml", "llama3"])
def test_replies_are_transformers_greedy_replies_batched_or_alone(model, request):
    imported = request.getfixturevalue(model)
    generator, ends = imported.generator, list(imported.generator.end_ids)
    chats = [Chat.of(conversation) for conversation in CONVERSATIONS]
    batched = generator.generate_rows(chats, max_new_tokens=STEPS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(imported.hf_dir)
    for chat, conversation, row in zip(chats, CONVERSATIONS, batched):
        theirs = greedy_reply(imported.hf, template_ids(imported.hf_dir, conversation), STEPS,
                              ends)
        assert row.tokens + ([row.end_token] if row.end_token is not None else []) == theirs
        ended = theirs[-1] in ends
        assert row.text == tokenizer.decode(theirs[:-1] if ended else theirs,
                                            skip_special_tokens=True)
        assert row.finish_reason == ("stop" if ended else "length")
        assert generator.generate([chat], max_new_tokens=STEPS) == [row.text]


def test_an_end_token_besides_eos_ends_the_reply(chatml):
    (row,) = chatml.generator.generate_rows([Chat.of(CONVERSATIONS[0])], max_new_tokens=STEPS)
    assert len(row.tokens) == chatml.cut and row.end_token == chatml.end
    assert row.finish_reason == "stop"
    # beam search (beam 1: greedy) ends there too
    (ids,) = chatml.generator.encode([Chat.of(CONVERSATIONS[0])])
    prompt = torch.tensor([ids])
    found = beam_search(chatml.generator.model, prompt, bos_id=prompt[:, -1],
                        eos_id=(EOS, chatml.end), beam=1, max_len=STEPS)
    assert found[0][0].tokens == row.tokens
    assert chatml.generator.chat(CONVERSATIONS[0], max_new_tokens=STEPS, beam=3) != ""


def test_several_end_tokens_are_ends_to_the_beam_search_as_one_is():
    logits = torch.randn(2 * 3, 11)
    scores = torch.zeros(2, 3)
    one = best_extensions(logits, scores, 3, 4)
    two = best_extensions(logits, scores, 3, (4, 7))
    assert torch.equal(one.is_eos, one.top_token == 4)
    assert torch.equal(two.is_eos, (two.top_token == 4) | (two.top_token == 7))
    assert torch.equal(best_extensions(logits, scores, 3, (4,)).is_eos, one.is_eos)


def test_the_template_goes_with_saves_averages_and_the_onnx_export(chatml, tmp_path):
    expected = checkpoint.load_tokenizer(chatml.out)
    # a fine-tuning's save names the checkpoint's tokenizer.json
    saved = checkpoint.save(tmp_path / "tuned", load_model(chatml.out), None,
                            chatml.out / "tokenizer.json")
    averaged = checkpoint.average([chatml.out, saved], tmp_path / "averaged")
    for path in (saved, averaged):
        copy = checkpoint.load_tokenizer(path)
        assert (copy.chat_template, copy.stop_ids) == (expected.chat_template,
                                                       expected.stop_ids)
    assert main(["export", "onnx", str(chatml.out), str(tmp_path / "onnx")]) == 0
    onnx = Generator.load(tmp_path / "onnx")
    for conversation in CONVERSATIONS:
        assert onnx.chat(conversation, max_new_tokens=STEPS) == \
            chatml.generator.chat(conversation, max_new_tokens=STEPS)


def test_the_export_to_transformers_has_the_template_and_the_end_tokens(chatml, tmp_path):
    assert main(["export", "hf", str(chatml.out), str(tmp_path / "hf")]) == 0
    for conversation in CONVERSATIONS:
        assert template_ids(tmp_path / "hf", conversation) == \
            template_ids(chatml.hf_dir, conversation)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert generation.eos_token_id == [EOS, chatml.end]
    back = import_llama(tmp_path / "hf", tmp_path / "back")
    again, before = section(back)["chat_template"], section(chatml.out)["chat_template"]
    assert again["template"] == before["template"]
    for name in ("bos_token", "eos_token"):      # the export names bos, eos and pad only
        assert again["tokens"][name] == before["tokens"][name]
    assert section(back)["stop_ids"] == [chatml.end]


def test_the_ctranslate2_export_has_the_template_and_the_end_tokens(chatml, tmp_path):
    """CTranslate2 has no chat template: transformers' tokenizer in the export lays the
    conversation out, and the marker's end tokens stop the Generator's reply where ours
    stops."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    assert main(["export", "ct2", str(chatml.out), str(tmp_path / "ct2")]) == 0
    marker = json.loads((tmp_path / "ct2" / "transduce-export.json").read_text())
    generator = ctranslate2.Generator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    tokenizer = chatml.generator.tokenizer
    for conversation in CONVERSATIONS:
        ids = template_ids(tmp_path / "ct2", conversation)
        assert ids == template_ids(chatml.hf_dir, conversation)
        (found,) = generator.generate_batch([[tokenizer.piece(t) for t in ids]],
                                            max_length=STEPS, sampling_topk=1,
                                            include_prompt_in_result=False,
                                            end_token=marker["end_tokens"])
        (row,) = chatml.generator.generate_rows([Chat.of(conversation)],
                                                max_new_tokens=STEPS)
        assert found.sequences_ids[0] == row.tokens
    assert marker["end_tokens"] == [tokenizer.piece(EOS), tokenizer.piece(chatml.end)]


def test_a_model_without_a_template_refuses_a_chat_by_name(tmp_path):
    (tmp_path / "vocabulary").mkdir()
    hf_checkpoint(tmp_path / "hf", write_spm_bpe(tmp_path / "vocabulary"),
                  hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, max_position_embeddings=32)
    generator = Generator.load(import_llama(tmp_path / "hf", tmp_path / "ours"))
    assert "stop_ids" not in section(tmp_path / "ours")
    with pytest.raises(ConfigError, match="this model has no chat template"):
        generator.chat([{"role": "user", "content": "Hello"}])
    assert generator.generate(["Hello"], max_new_tokens=3)       # plain prompts still work


@pytest.mark.parametrize("change,message", [
    (lambda s: s["chat_template"].update(template="{% for m in messages %}"),
     "chat_template: not a Jinja template"),
    (lambda s: s.update(chat_template="{{ messages }}"), "must be an object"),
    (lambda s: s.update(stop_ids="3"), "stop_ids must be a list of ids"),
    (lambda s: s.update(stop_ids=[100000]), "stop_id=100000 is not an id of the vocabulary"),
])
def test_a_corrupt_record_is_named(chatml, tmp_path, change, message):
    copy = checkpoint.save(tmp_path / "copy", load_model(chatml.out), None,
                           chatml.out / "tokenizer.json")
    values = json.loads((copy / "config.json").read_text())
    change(values["tokenizer"])
    (copy / "config.json").write_text(json.dumps(values))
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load_tokenizer(copy)


def test_an_import_takes_chat_template_jinja_and_refuses_a_broken_template(chatml, tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for file in chatml.hf_dir.iterdir():
        (hf_dir / file.name).write_bytes(file.read_bytes())
    (hf_dir / "chat_template.jinja").write_text(LLAMA3)        # transformers 4.43's file
    out = import_llama(hf_dir, tmp_path / "ours")
    assert section(out)["chat_template"]["template"] == LLAMA3
    (hf_dir / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ForeignCheckpointError, match="chat_template.jinja: not a Jinja"):
        import_llama(hf_dir, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    (hf_dir / "chat_template.jinja").unlink()
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "x"]}))
    with pytest.raises(ForeignCheckpointError, match="generation_config.json: eos_token_id"):
        import_llama(hf_dir, tmp_path / "refused")


def test_chat_holds_a_conversation_and_leaves_out_what_no_longer_fits(chatml, tmp_path,
                                                                     monkeypatch, capsys):
    lines = ["Hello world!", "In the beginning", "¿verdad que sí?"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    system = {"role": "system", "content": "Answer in Spanish."}
    generator = chatml.generator
    alone = max(len(ids) for ids in generator.encode(
        [Chat.of([system, {"role": "user", "content": line}]) for line in lines]))
    # 8 new tokens: the whole conversation fits; all the context leaves a message alone:
    # each message is answered without the exchanges before it
    for max_new, kept in ((8, 3), (generator.context - alone, 1)):
        monkeypatch.setattr("sys.stdin", open(tmp_path / "in.txt", encoding="utf-8"))
        # float32, as chatml.generator (--dtype auto is bfloat16 on a CPU with AMX)
        assert main(["chat", "--model", str(chatml.out), "--system", system["content"],
                     "--max-new-tokens", str(max_new), "--dtype", "float32"]) == 0
        out, err = capsys.readouterr()
        history, expected = [], []
        for line in lines:
            history = history[-2 * (kept - 1):] if kept > 1 else []
            reply = chatml.generator.chat([system, *history, {"role": "user", "content": line}],
                                          max_new_tokens=max_new)
            expected.append(reply)
            history += [{"role": "user", "content": line},
                        {"role": "assistant", "content": reply}]
        assert out == "".join(reply.replace("\n", "\\n") + "\n" for reply in expected)
        assert ("left out" in err) == (kept == 1)


def test_generate_chat_answers_each_line_as_a_users_message(chatml, capsys):
    assert main(["generate", "--chat", "--model", str(chatml.out), "--system", "Be brief.",
                 "--max-new-tokens", "6", "--prompt", "Hello world!", "--prompt", "Ça",
                 "--dtype", "float32"]) == 0
    expected = [chatml.generator.chat([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": text}], max_new_tokens=6)
                for text in ("Hello world!", "Ça")]
    assert capsys.readouterr().out == "".join(text.replace("\n", "\\n") + "\n"
                                              for text in expected)
    assert main(["generate", "--model", str(chatml.out), "--system", "x", "--prompt", "a"]) == 2
    assert "--system applies to --chat's conversations: give --chat too" in \
        capsys.readouterr().err


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.mark.parametrize("variables", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("conversation", [CONVERSATIONS[0], THOUGHT], ids=["one", "thought"])
def test_template_variables_give_apply_chat_templates_ids_and_its_reply(thinking, variables,
                                                                        conversation):
    """Qwen3's enable_thinking=False: the ids and the greedy reply are transformers'."""
    (ids,) = thinking.generator.encode([Chat.of(conversation, variables=variables)])
    expected = template_ids(thinking.hf_dir, conversation, **variables)
    assert ids == expected
    assert (ids != template_ids(thinking.hf_dir, conversation)) == bool(variables)
    generator = thinking.generator
    (row,) = generator.generate_rows([Chat.of(conversation, variables=variables)],
                                     max_new_tokens=STEPS)
    theirs = greedy_reply(thinking.hf, expected, STEPS, list(generator.end_ids))
    assert row.tokens + ([row.end_token] if row.end_token is not None else []) == theirs
    assert generator.chat(conversation, template_variables=variables,
                          max_new_tokens=STEPS) == row.text


def test_template_vars_on_the_command_line(thinking, tmp_path, monkeypatch, capsys):
    variables = {"enable_thinking": False}
    message = {"role": "user", "content": "Hello world!"}
    expected = thinking.generator.chat([message], template_variables=variables,
                                       max_new_tokens=6).replace("\n", "\\n") + "\n"
    assert main(["generate", "--chat", "--model", str(thinking.out), "--template-var",
                 "enable_thinking=false", "--max-new-tokens", "6", "--prompt",
                 message["content"]]) == 0
    assert capsys.readouterr().out == expected
    (tmp_path / "in.txt").write_text(message["content"] + "\n", encoding="utf-8")
    monkeypatch.setattr("sys.stdin", open(tmp_path / "in.txt", encoding="utf-8"))
    assert main(["chat", "--model", str(thinking.out), "--template-var",
                 "enable_thinking=false", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected
    for arguments, message in (
            (["--template-var", "enable_thinking=false"], "--template-var applies to --chat"),
            (["--chat", "--template-var", "messages=[]"], "--template-var.messages: the "
                                                          "template's messages is set by the "
                                                          "chat itself"),
            (["--chat", "--template-var", "eos_token=x"], "--template-var.eos_token: the "
                                                          "template's eos_token is the "
                                                          "model's special token")):
        assert main(["generate", "--model", str(thinking.out), "--prompt", "a",
                     *arguments]) != 0
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):                   # argparse's usage error
        main(["generate", "--chat", "--model", str(thinking.out), "--prompt", "a",
              "--template-var", "enable_thinking"])
    assert "'enable_thinking': expected NAME=VALUE" in capsys.readouterr().err


def test_tools_and_calls_reach_the_template_as_transformers_passes_them(tool_caller):
    """Generator.chat(tools=...) is the reply to apply_chat_template(tools=...)'s ids;
    an assistant's calls (arguments as JSON text, or as an object) and a tool's result
    are written as transformers writes them with the arguments as objects."""
    from tests.chat_models import ASKS, CALLS, TOOLS

    generator = tool_caller.generator
    assert generator.chat(ASKS, tools=TOOLS, max_new_tokens=60) == CALLS
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}
    history = [*ASKS, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    as_text = [*history[:1], {**history[1], "tool_calls": [
        {**call, "function": {**call["function"], "arguments": '{"city": "Tokyo"}'}}]},
        history[2]]
    expected = template_ids(tool_caller.hf_dir, history, tools=TOOLS)
    for given in (history, as_text):
        assert generator.encode([Chat.of(given, tools=TOOLS)]) == [expected]


@pytest.mark.parametrize("message,words", [
    ({"role": "assistant", "content": None}, "[0].content: expected a string"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": 3}]},
     "[0].tool_calls[0]: expected"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{"}}]},
     "[0].tool_calls[0].function.arguments: not JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"arguments": "{}"}}]}, "[0].tool_calls[0].function.name"),
    ({"role": "tool", "content": "sunny", "tool_call_id": 7}, "[0].tool_call_id"),
])
def test_a_malformed_call_or_result_is_named(message, words):
    from transduce.data.chat import ChatError

    with pytest.raises(ChatError, match=re.escape(words)):
        Chat.of([message])
    with pytest.raises(ChatError, match=re.escape("tools[0]: expected an object")):
        Chat.of([{"role": "user", "content": "a"}], tools=["get_weather"])


def test_chat_shows_reasoning_on_standard_error_and_keeps_it_apart(reasoning, tmp_path,
                                                                   monkeypatch, capsys):
    """A thinking model at `transduce chat`: the answers alone on standard output, the
    reasoning on standard error, and the next turn's history carries the earlier reply
    as the server would give it back (its reasoning as reasoning_content)."""
    from transduce.data.reasoning import split_reasoning

    system, lines = CONVERSATIONS[1][0], ["In the beginning", "El niño"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    ((close, bias),) = reasoning.bias.items()
    monkeypatch.setattr("sys.stdin", open(tmp_path / "in.txt", encoding="utf-8"))
    assert main(["chat", "--model", str(reasoning.out), "--system", system["content"],
                 "--max-new-tokens", "24", "--logit-bias", f"{close}={bias}"]) == 0
    out, err = capsys.readouterr()
    history, answers, thoughts = [system], [], []
    for line in lines:
        history.append({"role": "user", "content": line})
        reply = reasoning.generator.chat(history, max_new_tokens=24,
                                         logit_bias={int(close): bias})
        thought, answer = split_reasoning(reply, inside=True)
        history.append({"role": "assistant", "content": answer, "reasoning_content": thought})
        answers.append(answer)
        thoughts.append(thought)
    assert out == "".join(answer.replace("\n", "\\n") + "\n" for answer in answers)
    assert thoughts[0].strip() and answers[0].strip()
    assert err == "".join(thought.replace("\n", "\\n") + "\n" for thought in thoughts
                          if thought)


def test_chat_with_a_schema_reasons_freely_and_keeps_the_answer_to_it(reasoning, tmp_path,
                                                                       monkeypatch, capsys):
    """--json-schema at `transduce chat` with a thinking model: the reasoning is its free
    reply's (standard error), the answer an instance of the schema (standard output), as
    the server's response_format gives them. This model's vocabulary spells no braces:
    the schema is a JSON boolean."""
    from transduce.data.reasoning import reasoning_grammar, split_reasoning

    system, line = CONVERSATIONS[1][0], CONVERSATIONS[1][1]["content"]
    schema = tmp_path / "yes.json"
    schema.write_text(json.dumps({"type": "boolean"}), encoding="utf-8")
    (tmp_path / "in.txt").write_text(line + "\n", encoding="utf-8")
    ((close, bias),) = reasoning.bias.items()
    monkeypatch.setattr("sys.stdin", open(tmp_path / "in.txt", encoding="utf-8"))
    assert main(["chat", "--model", str(reasoning.out), "--system", system["content"],
                 "--max-new-tokens", "40", "--logit-bias", f"{close}={bias}",
                 "--json-schema", str(schema)]) == 0
    out, err = capsys.readouterr()
    conversation = [system, {"role": "user", "content": line}]
    free = reasoning.generator.chat(conversation, max_new_tokens=24,
                                    logit_bias={int(close): bias})
    kept = reasoning.generator.chat(
        conversation, max_new_tokens=40, logit_bias={int(close): bias},
        grammar=reasoning_grammar(json.dumps({"json": {"type": "boolean"}}), inside=True))
    thought, answer = split_reasoning(kept, inside=True)
    assert thought and thought == split_reasoning(free, inside=True)[0]
    assert err == thought.replace("\n", "\\n") + "\n"
    assert out == answer.replace("\n", "\\n") + "\n" and answer.strip() in ("true", "false")


@pytest.mark.parametrize("stream", [False, True])
def test_generate_chat_with_a_schema_reasons_freely_and_keeps_the_answer_to_it(
        reasoning, tmp_path, stream, capsys):
    """--json-schema at `transduce generate --chat` with a thinking model: the reply, whole
    as generate prints it, is its free reasoning and then an instance of the schema, the
    same as `chat` gives (the prompt's template opened the reasoning block), batched and
    streamed."""
    from transduce.data.reasoning import reasoning_grammar, split_reasoning

    system, line = CONVERSATIONS[1][0], CONVERSATIONS[1][1]["content"]
    schema = tmp_path / "yes.json"
    schema.write_text(json.dumps({"type": "boolean"}), encoding="utf-8")
    ((close, bias),) = reasoning.bias.items()
    assert main(["generate", "--chat", "--model", str(reasoning.out), "--system",
                 system["content"], "--max-new-tokens", "40", "--logit-bias",
                 f"{close}={bias}", "--json-schema", str(schema), "--prompt", line,
                 "--prompt", line] + (["--stream"] if stream else [])) == 0
    out = capsys.readouterr().out
    conversation = [system, {"role": "user", "content": line}]
    kept = reasoning.generator.chat(
        conversation, max_new_tokens=40, logit_bias={int(close): bias},
        grammar=reasoning_grammar(json.dumps({"json": {"type": "boolean"}}), inside=True))
    thought, answer = split_reasoning(kept, inside=True)
    assert thought and answer.strip() in ("true", "false")
    assert out == 2 * (kept.replace("\n", "\\n") + "\n")
