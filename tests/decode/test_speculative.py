"""Speculative greedy search (decode/speculative.py), its drafts by prompt lookup (the
n-gram index drafts what followed the latest earlier occurrence) or by a draft model: a
step keeps the drafted tokens greedy search confirms, and generation gives greedy
search's output for every cache, layout and limit, with drafts both kept and rejected
along the way, penalized or not; a cache that cannot rewind, beam search and a draft of
another tokenizer are refused (sampling: test_speculative_sampling.py)."""

import pytest
import torch

from transduce.attention.kv_cache import KVCache, QuantizedKVCache
from transduce.attention.linear import LinearStateCache
from transduce.attention.local import SlidingKVCache
from transduce.cli import main
from transduce.config import ConfigError, preset
from transduce.data.tokenizer import Tokenizer
from transduce.decode.continuous_generation import ContinuousGeneration
from transduce.decode.generate import Generator, PromptIds
from transduce.decode.draft_model import DraftModel
from transduce.decode.lookup import NgramIndex
from transduce.decode.speculative import DraftLength, accepted, speculative_steps
from transduce.decode.options import GenerateOptions
from transduce.model import build_model
from transduce.model import int8 as int8_module
from tests.model.test_int8_rows import INT8_LAYERS

PROMPTS = ["uno dos tres uno dos tres uno", "el perro grande come el perro", "casa",
           "tres gato rojo rojo el casa perro gato rojo"]


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    return Tokenizer(tiny_corpus / "spm.model")


def language_model(tokenizer, name="gpt-tiny", seed=0, **changes):
    torch.manual_seed(seed)
    return build_model(preset(name, src_vocab_size=tokenizer.vocab_size,
                              tgt_vocab_size=tokenizer.vocab_size, max_positions=64,
                              **changes)).eval()


def noisy_copy(tokenizer):
    """language_model() with noise added to its weights: a draft model that agrees with
    it now and then."""
    noisy = language_model(tokenizer)
    torch.manual_seed(5)
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn_like(parameter))
    return noisy


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
    with pytest.raises(ValueError, match="LinearStateCache cannot forget"):
        LinearStateCache(1, 1, 4).rewind(0)


def test_a_sliding_window_cache_forgets_as_many_tokens_as_it_was_allowed_to():
    """It holds the window and the tokens it may forget; forgetting more would leave
    the next token fewer keys than its window."""
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 12, 4)
    cache = SlidingKVCache(1, 1, 3, 4, max_len=12)
    cache.allow_rewind(2)
    assert cache.capacity == 5
    cache.update(keys[:, :, :6], keys[:, :, :6])          # holds positions 1 to 5
    cache.rewind(4)
    k, _ = cache.update(keys[:, :, 6:8], keys[:, :, 6:8])
    assert torch.equal(k, torch.cat([keys[:, :, 1:4], keys[:, :, 6:8]], dim=2))
    with pytest.raises(ValueError, match="cannot rewind a sliding-window cache of 6 tokens "
                                         "to 3: it holds the window of 3 and 2 tokens more"):
        cache.rewind(3)
    cache.rewind(4)
    k, _ = cache.update(keys[:, :, 8:9], keys[:, :, 8:9])
    assert torch.equal(k, torch.cat([keys[:, :, 1:4], keys[:, :, 8:9]], dim=2))
    unallowed = SlidingKVCache(1, 1, 3, 4)
    unallowed.update(keys[:, :, :6], keys[:, :, :6])
    unallowed.rewind(6)
    with pytest.raises(ValueError, match="and 0 tokens more that it may forget"):
        unallowed.rewind(5)
    short = SlidingKVCache(1, 1, 3, 4)                      # fewer tokens than the window
    short.allow_rewind(1)
    short.update(keys[:, :, :2], keys[:, :, :2])
    short.rewind(0)
    assert short.held == 0 and short.length == 0


@pytest.mark.parametrize("draft_by", ["prompt lookup", "draft model"])
@pytest.mark.parametrize("name,changes,settings", [
    ("gpt-tiny", {}, {}),
    ("gpt-tiny", {}, {"kv_dtype": "int8"}),
    ("gpt-tiny", {}, {"kv_dtype": "int4"}),
    ("gpt-tiny", {"positional": "sinusoidal", "norm_first": False}, {}),
    ("llama-tiny", {}, {}),
    ("llama-tiny", {"num_kv_heads": 1}, {}),
    ("llama-tiny", {}, {"dtype": "int8"}),
    ("gpt-tiny", {"attention_type": "sliding", "attention_window": 4}, {}),
    ("llama-tiny", {"attention_type": "sliding", "attention_window": 3}, {}),
    ("gpt-tiny", {"attention_type": "sliding", "attention_window": 4}, {"kv_dtype": "int8"}),
    ("llama-tiny", {"attention_type": "sliding", "attention_window": 3}, {"kv_dtype": "int4"}),
])
def test_generation_is_greedy_search_s_for_every_draft_length(tokenizer, name, changes,
                                                               settings, draft_by,
                                                               monkeypatch):
    """In float32 and int8 (activations quantized per row): bfloat16 rounds a step of
    several tokens otherwise than one of one, which can turn a near tie of a random
    model's logits, as batching prompts together can."""
    if settings.get("dtype") == "int8":
        if not int8_module.int8_available():
            pytest.skip("no oneDNN int8 ops")
        monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    window = {key: value for key, value in changes.items() if key.startswith("attention")}
    draft = Generator(language_model(tokenizer, seed=1, **window), tokenizer, **settings)
    generator = Generator(language_model(tokenizer, name, **changes), tokenizer, **settings,
                          draft=draft)
    if settings.get("dtype") == "int8":
        assert any(isinstance(m, INT8_LAYERS) for m in generator.model.modules())
    greedy = generator.generate_rows(PROMPTS, max_new_tokens=30)
    for drafts in (1, 3, 8):
        setting = {"prompt_lookup" if draft_by == "prompt lookup" else "draft_tokens": drafts}
        looked_up = generator.generate_rows(PROMPTS, max_new_tokens=30, **setting)
        assert [row.tokens for row in looked_up] == [row.tokens for row in greedy]
        assert [row.finish_reason for row in looked_up] == \
            [row.finish_reason for row in greedy]


@pytest.mark.parametrize("draft_by", ["prompt lookup", "draft model"])
@pytest.mark.parametrize("settings", [
    {"repetition_penalty": 1.4}, {"frequency_penalty": 0.4}, {"presence_penalty": 0.5},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "logit_bias": {7: 2.0, 30: -4.0}},
])
def test_penalized_generation_is_penalized_greedy_search_s(tokenizer, draft_by, settings):
    """Each drafted place's logits are penalized as if the drafted tokens before it had
    been generated: the output is the undrafted search's, token for token, with drafts
    kept and rejected along the way (the penalties change what is generated)."""
    draft = Generator(noisy_copy(tokenizer), tokenizer)
    generator = Generator(language_model(tokenizer), tokenizer, draft=draft)
    options = GenerateOptions(max_new_tokens=30, **settings)
    greedy = generator.generate_rows(PROMPTS, options)
    assert [row.tokens for row in greedy] != \
        [row.tokens for row in generator.generate_rows(PROMPTS, max_new_tokens=30)]
    name = "prompt_lookup" if draft_by == "prompt lookup" else "draft_tokens"
    for drafts in (1, 4):
        drafted = generator.generate_rows(PROMPTS, options.replace(**{name: drafts}))
        assert [row.tokens for row in drafted] == [row.tokens for row in greedy]
    kept = total = 0
    for ids in generator.encode(PROMPTS):
        row = generator.continuation(ids, options)
        penalties = generator._penalties([ids], options)
        drafter = NgramIndex(ids) if draft_by == "prompt lookup" else \
            DraftModel(draft.model, ids, row.limit + 5, penalties=penalties)
        with torch.inference_mode():
            for step_drafted, step_kept in speculative_steps(
                    generator.model, torch.tensor([ids]), row, drafter, 4,
                    penalties=penalties):
                kept, total = kept + step_kept, total + step_drafted
    assert 0 < kept < total


@pytest.mark.parametrize("draft_by", ["prompt lookup", "draft model"])
def test_steps_keep_some_drafts_and_reject_others(tokenizer, draft_by):
    """The random model's continuations repeat themselves, so prompt lookup finds drafts,
    and a copy of it with noise added to its weights agrees with it now and then: some
    drafts are kept, some rejected (the caches of both models rewound), and fewer steps
    than tokens are taken."""
    generator = Generator(language_model(tokenizer), tokenizer)
    draft = Generator(noisy_copy(tokenizer), tokenizer)
    options = GenerateOptions(max_new_tokens=40)
    drafted = kept = steps = tokens = 0
    for ids in generator.encode(PROMPTS):
        row = generator.continuation(ids, options)
        drafter = NgramIndex(ids) if draft_by == "prompt lookup" else \
            DraftModel(draft.model, ids, row.limit + 7)
        with torch.inference_mode():
            for step_drafted, step_kept in speculative_steps(
                    generator.model, torch.tensor([ids]), row, drafter, drafts=6):
                drafted, kept, steps = drafted + step_drafted, kept + step_kept, steps + 1
        tokens += len(row.tokens) + row.ended
        assert row.tokens == generator.generate_rows([PromptIds(ids)],
                                                     max_new_tokens=40)[0].tokens
    assert 0 < kept < drafted
    assert steps < tokens


def test_an_adaptive_schedule_drafts_fewer_after_a_rejection_more_after_a_whole_draft():
    constant, adaptive = DraftLength(5, adaptive=False), DraftLength(5, adaptive=True)
    counts = []
    for drafted, kept in [(5, 2), (4, 4), (5, 0), (4, 1), (3, 0), (2, 0), (1, 0), (0, 0),
                          (1, 1), (3, 3), (5, 5)]:
        for length in (constant, adaptive):
            length.update(drafted, kept)
        counts.append(adaptive.count)
        assert constant.count == 5
    assert counts == [4, 5, 4, 3, 2, 1, 1, 1, 3, 5, 5]    # no draft (lookup found none): kept


@pytest.mark.parametrize("draft_by", ["prompt lookup", "draft model"])
def test_an_adaptive_schedule_gives_greedy_search_s_output(tokenizer, draft_by):
    """The drafter is asked for fewer tokens after rejections (never more than K, never
    none), and the output stays greedy search's."""
    draft = Generator(noisy_copy(tokenizer), tokenizer)
    generator = Generator(language_model(tokenizer), tokenizer, draft=draft)
    greedy = generator.generate_rows(PROMPTS, max_new_tokens=30)
    name = "prompt_lookup" if draft_by == "prompt lookup" else "draft_tokens"
    adaptive = generator.generate_rows(PROMPTS, max_new_tokens=30, draft_schedule="adaptive",
                                       **{name: 6})
    assert [row.tokens for row in adaptive] == [row.tokens for row in greedy]
    asked = []
    for ids in generator.encode(PROMPTS):
        row = generator.continuation(ids, GenerateOptions(max_new_tokens=30))
        drafter = NgramIndex(ids) if draft_by == "prompt lookup" else \
            DraftModel(draft.model, ids, row.limit + 7)
        draft_of = drafter.draft
        drafter.draft = lambda count, draft_of=draft_of: asked.append(count) or draft_of(count)
        with torch.inference_mode():
            for _ in speculative_steps(generator.model, torch.tensor([ids]), row, drafter, 6,
                                       adaptive=True):
                pass
    limited = [count for count in asked if count < 6]
    assert limited and max(asked) == 6 and min(asked) >= 0


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


@pytest.mark.parametrize("name", ["prompt_lookup", "draft_tokens"])
@pytest.mark.parametrize("settings,match", [
    ({"beam": 2}, "=4: drafted tokens speed up greedy search and sampling"),
    ({"@": -1}, "=-1: must be an integer >= 0"),
    ({"@": 2.5}, "=2.5: must be an integer >= 0"),
])
def test_what_a_speculative_search_cannot_do_is_refused_naming_it(name, settings, match):
    settings = {name if key == "@" else key: value for key, value in settings.items()}
    with pytest.raises(ConfigError, match=f"GenerateOptions.{name}{match}"):
        GenerateOptions(**{name: 4, **settings})
    with pytest.raises(ConfigError, match="from prompt lookup or from a draft model; choose"):
        GenerateOptions(prompt_lookup=2, draft_tokens=3)
    with pytest.raises(ConfigError, match="draft_schedule='fast': choose one of adaptive, "
                                          "constant"):
        GenerateOptions(**{name: 4}, draft_schedule="fast")


def test_a_cache_that_cannot_rewind_is_refused_naming_the_attention(tokenizer):
    generator = Generator(language_model(tokenizer, attention_type="linear"), tokenizer)
    with pytest.raises(ConfigError, match="the model's attention_type is 'linear'"):
        generator.generate(PROMPTS, prompt_lookup=4)
    with pytest.raises(ConfigError, match="the draft model's attention_type is 'linear'"):
        Generator(language_model(tokenizer), tokenizer, draft=generator)
    for setting in ({"prompt_lookup": 4}, {"draft_tokens": 2}):
        with pytest.raises(ValueError, match="a speculative search runs each prompt alone"):
            ContinuousGeneration(Generator(language_model(tokenizer), tokenizer),
                                 GenerateOptions(**setting))


def test_a_draft_model_of_another_tokenizer_or_none_at_all_is_refused(tokenizer, tiny_corpus):
    other = Tokenizer(tiny_corpus / "spm.model")
    other.fingerprint = "another vocabulary"
    draft = Generator(language_model(tokenizer), other)
    with pytest.raises(ConfigError, match="the draft model's tokenizer .* is not the model's"):
        Generator(language_model(tokenizer), tokenizer, draft=draft)
    wider = Generator(build_model(preset("gpt-tiny", src_vocab_size=tokenizer.vocab_size + 8,
                                         tgt_vocab_size=tokenizer.vocab_size + 8)), tokenizer)
    with pytest.raises(ConfigError, match=f"scores {tokenizer.vocab_size + 8} tokens and the "
                                          f"model {tokenizer.vocab_size}"):
        Generator(language_model(tokenizer), tokenizer, draft=wider)
    with pytest.raises(ConfigError, match="draft: expected a Generator"):
        Generator(language_model(tokenizer), tokenizer, draft=language_model(tokenizer))
    with pytest.raises(ConfigError, match="draft_tokens drafts with a draft model, and this "
                                          "Generator has none"):
        Generator(language_model(tokenizer), tokenizer).generate(PROMPTS, draft_tokens=3)


def test_a_draft_model_of_fewer_positions_stops_drafting_where_they_end(tokenizer):
    """A draft that reads 24 positions for a model of 64: it drafts while the sequence
    fits, then greedy search goes on alone; the text is greedy search's."""
    torch.manual_seed(0)
    short = Generator(build_model(preset("gpt-tiny", src_vocab_size=tokenizer.vocab_size,
                                         tgt_vocab_size=tokenizer.vocab_size,
                                         max_positions=24)).eval(), tokenizer)
    generator = Generator(language_model(tokenizer), tokenizer, draft=short)
    want = generator.generate(PROMPTS, max_new_tokens=40)
    assert generator.generate(PROMPTS, max_new_tokens=40, draft_tokens=4) == want


def test_a_draft_model_that_is_the_model_has_every_draft_kept(tokenizer):
    """The model drafting for itself: every drafted token is its own greedy choice."""
    generator = Generator(language_model(tokenizer), tokenizer)
    ids = generator.encode(PROMPTS[:1])[0]
    row = generator.continuation(ids, GenerateOptions(max_new_tokens=30))
    with torch.inference_mode():
        steps = list(speculative_steps(generator.model, torch.tensor([ids]), row,
                                       DraftModel(generator.model, ids, 40), drafts=4))
    assert all(kept == drafted for drafted, kept in steps)
    assert len(steps) == -(-(len(row.tokens) + row.ended) // 5)
    assert row.tokens == generator.generate_rows([PromptIds(ids)], max_new_tokens=30)[0].tokens


def test_the_cli_prints_greedy_search_s_lines_penalized_or_not(tokenizer, tiny_corpus,
                                                               tmp_path, capsys):
    from transduce import checkpoint

    checkpoint.save(tmp_path / "lm", language_model(tokenizer), None, tiny_corpus / "spm.model")
    checkpoint.save(tmp_path / "draft", language_model(tokenizer, "llama-tiny", seed=2), None,
                    tiny_corpus / "spm.model")
    lines = []
    for extra in ([], ["--prompt-lookup", "5"], ["--draft-model", str(tmp_path / "draft")],
                  ["--draft-model", str(tmp_path / "draft"), "--draft-tokens", "2"]):
        assert main(["generate", "--model", str(tmp_path / "lm"), "--prompt", PROMPTS[0],
                     "--prompt", PROMPTS[1], "--max-new-tokens", "20", *extra]) == 0
        lines.append(capsys.readouterr().out)
    assert lines[1:] == lines[:1] * 3 and lines[0].count("\n") == 2
    penalized = []
    for extra in ([], ["--prompt-lookup", "5"], ["--draft-model", str(tmp_path / "draft")]):
        assert main(["generate", "--model", str(tmp_path / "lm"), "--prompt", PROMPTS[0],
                     "--max-new-tokens", "20", "--repetition-penalty", "1.3",
                     "--presence-penalty", "0.5", *extra]) == 0
        penalized.append(capsys.readouterr().out)
    assert penalized[1:] == penalized[:1] * 2
    assert penalized[0] != lines[0].splitlines(keepends=True)[0]     # the penalties told
    assert main(["generate", "--model", str(tmp_path / "lm"), "--prompt", "uno",
                 "--prompt-lookup", "5", "--beam", "2"]) == 2
    assert "drafted tokens speed up greedy search and sampling" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "lm"), "--prompt", "uno",
                 "--draft-tokens", "3"]) == 2
    assert "--draft-tokens: the tokens a draft model drafts; give --draft-model" in \
        capsys.readouterr().err
