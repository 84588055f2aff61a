"""Prompt lookup decoding (decode/lookup.py): the n-gram index drafts what followed the
latest earlier occurrence, a step keeps the drafted tokens greedy search confirms, and
generation gives greedy search's output for every cache, layout and limit, with drafts
both kept and rejected along the way; what cannot rewind or is not greedy is refused."""

import pytest
import torch

from transduce.attention.kv_cache import KVCache, QuantizedKVCache
from transduce.attention.local import SlidingKVCache
from transduce.cli import main
from transduce.config import ConfigError, preset
from transduce.data.tokenizer import Tokenizer
from transduce.decode.continuous_generation import ContinuousGeneration
from transduce.decode.generate import Generator, PromptIds
from transduce.decode.lookup import NgramIndex, accepted, lookup_steps
from transduce.decode.options import GenerateOptions
from transduce.model import build_model
from transduce.model import int8 as int8_module

PROMPTS = ["uno dos tres uno dos tres uno", "el perro grande come el perro", "casa",
           "tres gato rojo rojo el casa perro gato rojo"]


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    return Tokenizer(tiny_corpus / "spm.model")


def language_model(tokenizer, name="gpt-tiny", **changes):
    torch.manual_seed(0)
    return build_model(preset(name, src_vocab_size=tokenizer.vocab_size,
                              tgt_vocab_size=tokenizer.vocab_size, max_positions=64,
                              **changes)).eval()


def test_the_index_drafts_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3])
    assert index.draft(2) == [5, 7]           # "2 3" last before the end: followed by 5 7
    assert index.draft(9) == [5, 7, 2, 3]     # up to the end of the sequence
    assert index.draft(0) == []
    index.extend([5])                         # "2 3 5" occurred: the longest n-gram wins
    assert index.draft(3) == [7, 2, 3]
    index.extend([8])                         # "8" never occurred before
    assert index.draft(3) == []
    assert NgramIndex([4]).draft(3) == [] and NgramIndex([4, 4]).draft(3) == [4]


def test_accepted_counts_the_drafted_tokens_up_to_the_first_greedy_search_rejects():
    assert accepted([5, 6, 7], [5, 6, 8, 1]) == 2
    assert accepted([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted([], [3]) == 0


def test_rewinding_a_cache_writes_the_next_tokens_over_the_forgotten_ones():
    torch.manual_seed(0)
    for cache in (KVCache(2, 2, 10, 4), QuantizedKVCache(2, 2, 10, 4)):
        keys = torch.randn(2, 2, 6, 4)
        cache.update(keys[:, :, :4], keys[:, :, :4])
        cache.rewind(2)
        k, _ = cache.update(keys[:, :, 4:6], keys[:, :, 4:6])
        expected = torch.cat([keys[:, :, :2], keys[:, :, 4:6]], dim=2)
        torch.testing.assert_close(k, expected, rtol=0, atol=0.02)
        with pytest.raises(ValueError, match="cannot rewind a cache of 4 tokens to 5"):
            cache.rewind(5)
    with pytest.raises(ValueError, match="SlidingKVCache cannot forget"):
        SlidingKVCache(1, 1, 4, 4).rewind(0)


@pytest.mark.parametrize("name,changes,settings", [
    ("gpt-tiny", {}, {}),
    ("gpt-tiny", {}, {"kv_dtype": "int8"}),
    ("gpt-tiny", {}, {"kv_dtype": "int4"}),
    ("gpt-tiny", {"positional": "sinusoidal", "norm_first": False}, {}),
    ("llama-tiny", {}, {}),
    ("llama-tiny", {"num_kv_heads": 1}, {}),
    ("llama-tiny", {}, {"dtype": "int8"}),
])
def test_generation_is_greedy_search_s_for_every_draft_length(tokenizer, name, changes,
                                                               settings, monkeypatch):
    """In float32 and int8 (activations quantized per row): bfloat16 rounds a step of
    several tokens otherwise than one of one, which can turn a near tie of a random
    model's logits, as batching prompts together can."""
    if settings.get("dtype") == "int8":
        if not int8_module.int8_available():
            pytest.skip("no oneDNN int8 ops")
        monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    generator = Generator(language_model(tokenizer, name, **changes), tokenizer, **settings)
    if settings.get("dtype") == "int8":
        assert any(isinstance(m, int8_module.Int8Linear) for m in generator.model.modules())
    greedy = generator.generate_rows(PROMPTS, max_new_tokens=30)
    for drafts in (1, 3, 8):
        looked_up = generator.generate_rows(PROMPTS, max_new_tokens=30, prompt_lookup=drafts)
        assert [row.tokens for row in looked_up] == [row.tokens for row in greedy]
        assert [row.finish_reason for row in looked_up] == \
            [row.finish_reason for row in greedy]


def test_steps_keep_some_drafts_and_reject_others(tokenizer):
    """The random model's continuations repeat themselves, so drafts are found: some are
    kept, some rejected (the caches rewound), and fewer steps than tokens are taken."""
    generator = Generator(language_model(tokenizer), tokenizer)
    options = GenerateOptions(max_new_tokens=40)
    drafted = kept = steps = tokens = 0
    for ids in generator.encode(PROMPTS):
        row = generator.continuation(ids, options)
        with torch.inference_mode():
            for step_drafted, step_kept in lookup_steps(generator.model, torch.tensor([ids]),
                                                        row, drafts=6):
                drafted, kept, steps = drafted + step_drafted, kept + step_kept, steps + 1
        tokens += len(row.tokens) + row.ended
        assert row.tokens == generator.generate_rows([PromptIds(ids)],
                                                     max_new_tokens=40)[0].tokens
    assert 0 < kept < drafted
    assert steps < tokens


def test_limits_stops_and_streams_are_greedy_search_s(tokenizer):
    generator = Generator(language_model(tokenizer), tokenizer)
    for settings in ({"max_new_tokens": 1}, {"max_new_tokens": 7}, {"stop": ("o",)},
                     {"max_new_tokens": 80}):          # past the context's 64 positions
        want = generator.generate(PROMPTS, **settings)
        assert generator.generate(PROMPTS, prompt_lookup=4, **settings) == want
        assert "".join(generator.stream(PROMPTS[0], prompt_lookup=4, **settings)) == want[0]
        streamed = ["", "", "", ""]
        for pieces in generator.stream_batch(PROMPTS, prompt_lookup=4, **settings):
            streamed = [text + piece for text, piece in zip(streamed, pieces)]
        assert streamed == want


@pytest.mark.parametrize("settings,match", [
    ({"temperature": 0.7}, "prompt lookup speeds up greedy search"),
    ({"beam": 2}, "prompt lookup speeds up greedy search"),
    ({"repetition_penalty": 1.2}, "prompt lookup speeds up greedy search"),
    ({"prompt_lookup": -1}, "prompt_lookup=-1: must be an integer >= 0"),
    ({"prompt_lookup": 2.5}, "prompt_lookup=2.5: must be an integer >= 0"),
])
def test_what_prompt_lookup_cannot_do_is_refused_naming_it(settings, match):
    with pytest.raises(ConfigError, match=match):
        GenerateOptions(**{"prompt_lookup": 4, **settings})


@pytest.mark.parametrize("changes", [{"attention_type": "sliding", "attention_window": 4},
                                     {"attention_type": "linear"}])
def test_a_cache_that_cannot_rewind_is_refused_naming_the_attention(tokenizer, changes):
    generator = Generator(language_model(tokenizer, **changes), tokenizer)
    with pytest.raises(ConfigError, match=f"attention_type is '{changes['attention_type']}'"):
        generator.generate(PROMPTS, prompt_lookup=4)
    with pytest.raises(ValueError, match="prompt lookup runs each prompt alone"):
        ContinuousGeneration(Generator(language_model(tokenizer), tokenizer),
                             GenerateOptions(prompt_lookup=4))


def test_the_cli_prints_greedy_search_s_lines_and_refuses_sampling(tokenizer, tiny_corpus,
                                                                    tmp_path, capsys):
    from transduce import checkpoint

    checkpoint.save(tmp_path / "lm", language_model(tokenizer), None, tiny_corpus / "spm.model")
    lines = []
    for extra in ([], ["--prompt-lookup", "5"]):
        assert main(["generate", "--model", str(tmp_path / "lm"), "--prompt", PROMPTS[0],
                     "--prompt", PROMPTS[1], "--max-new-tokens", "20", *extra]) == 0
        lines.append(capsys.readouterr().out)
    assert lines[1] == lines[0] and lines[0].count("\n") == 2
    assert main(["generate", "--model", str(tmp_path / "lm"), "--prompt", "uno",
                 "--prompt-lookup", "5", "--temperature", "0.5"]) == 2
    assert "prompt lookup speeds up greedy search" in capsys.readouterr().err
