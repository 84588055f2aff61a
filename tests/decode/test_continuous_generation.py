"""Continuous generation: prompts that join a running batch at any step, and leave it
when done, get what Generator.generate gives each alone (greedy, sampled with its seed,
with a repetition penalty and stop strings), through relayouts of the buffers."""

import random

import pytest
import torch

from transduce.config import preset
from transduce.data.tokenizer import Tokenizer
from transduce.decode import continuous_generation
from transduce.decode.continuous_generation import ContinuousGeneration, length_groups, \
    supports
from transduce.decode.generate import Generator, prompt_seeds
from transduce.decode.options import GenerateOptions
from transduce.model import build_model

pytestmark = pytest.mark.filterwarnings("ignore:max_new_tokens")   # the context's end

PROMPTS = ["uno dos", "el perro grande come", "casa", "", "tres gato rojo rojo el casa perro",
           "rojo", "el gato come la casa grande y el perro", "dos tres"]


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    return Tokenizer(tiny_corpus / "spm.model")


def _generator(tokenizer, dtype="float32", kv_dtype=None, **config):
    torch.manual_seed(0)
    settings = {"max_positions": 40, **config}
    model = build_model(preset("gpt-tiny", src_vocab_size=tokenizer.vocab_size,
                               tgt_vocab_size=tokenizer.vocab_size, **settings)).eval()
    return Generator(model, tokenizer, dtype=dtype, kv_dtype=kv_dtype)


@pytest.fixture(scope="module")
def generator(tokenizer):
    return _generator(tokenizer)


def generated_alone(generator, options, seeds):
    """Each of PROMPTS as the Generator gives it alone, with its seed when sampling."""
    return [generator.generate([p], options, seeds=None if seeds is None else [seed])[0]
            for p, seed in zip(PROMPTS, seeds or [None] * len(PROMPTS))]


def run_continuously(generation, generator, prompts, seeds, joins):
    """Add prompt i before step joins[i] (several may join at one step); step until all
    are done -> each prompt's text, and the number of steps."""
    ids = generator.encode(prompts)
    texts, step = {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: joins[i])
    while pending or generation.running:
        joining = [i for i in pending if joins[i] <= step]
        if joining:
            generation.add([ids[i] for i in joining], joining,
                           None if seeds is None else [seeds[i] for i in joining])
            pending = [i for i in pending if i not in joining]
        for tag, continuation in generation.step():
            assert continuation.finished
            texts[tag] = continuation.text
        step += 1
    return [texts[i] for i in range(len(prompts))], step


@pytest.mark.parametrize("settings", [
    {}, {"temperature": 0.9, "top_k": 20, "seed": 3}, {"temperature": 1.2, "top_p": 0.9},
    {"repetition_penalty": 1.6}, {"stop": ("a",)},
    {"frequency_penalty": 1.5, "presence_penalty": -0.5, "logit_bias": {5: 4.0, 9: -100}},
    {"temperature": 1.5, "min_p": 0.2, "seed": 5}, {"json_schema": {"type": "object"}},
    {"json_schema": {"type": "array", "items": {"type": "integer"}}, "temperature": 1.0}])
@pytest.mark.parametrize("joins", ["together", "staggered", "late"])
def test_continuous_equals_alone(generator, settings, joins):
    options = GenerateOptions(max_new_tokens=12, **settings)
    rng = random.Random(len(PROMPTS) + len(settings))
    when = {"together": [0] * len(PROMPTS),
            "staggered": [rng.randrange(0, 15) for _ in PROMPTS],
            "late": [3 * i for i in range(len(PROMPTS))]}[joins]
    seeds = None if options.greedy else prompt_seeds(options.seed or 11, len(PROMPTS))
    found, _ = run_continuously(ContinuousGeneration(generator, options), generator, PROMPTS,
                                seeds, when)
    alone = generated_alone(generator, options, seeds)
    assert found == alone
    assert sum(map(len, found)) > 20


def test_prompts_of_different_settings_share_the_batch(generator):
    """Greedy and sampled prompts of several temperatures, top_k and top_p, with and
    without penalties and biases, stop strings or a short limit, joining at different
    steps, each get what they get alone with their own settings."""
    kinds = [{}, {"temperature": 0.9, "top_k": 20}, {"temperature": 1.2, "top_p": 0.9},
             {"repetition_penalty": 1.6}, {"stop": ("a",)}, {"max_new_tokens": 3},
             {"temperature": 0.9, "top_k": 20, "repetition_penalty": 1.3,
              "frequency_penalty": 0.7},
             {"temperature": 1.2, "top_p": 0.9, "min_p": 0.1, "max_new_tokens": 5,
              "presence_penalty": 1.2, "logit_bias": {7: 3.0}}]
    options = [GenerateOptions(**{"max_new_tokens": 12, **kind}) for kind in kinds]
    seeds = [None if each.greedy else 40 + i for i, each in enumerate(options)]
    ids = generator.encode(PROMPTS)
    generation, texts = ContinuousGeneration(generator), {}
    joins = [[0, 1], [], [2, 3, 4], [], [], [5], [6, 7]]
    step = 0
    while step < len(joins) or generation.running:
        joining = joins[step] if step < len(joins) else []
        if joining:
            generation.add([ids[i] for i in joining], joining, [seeds[i] for i in joining],
                           [options[i] for i in joining])
            assert len(generation.samplers) <= 3
        texts.update((tag, c.text) for tag, c in generation.step())
        step += 1
    alone = [generator.generate([p], each, seeds=None if seed is None else [seed])[0]
             for p, each, seed in zip(PROMPTS, options, seeds)]
    assert [texts[i] for i in range(len(PROMPTS))] == alone
    assert generation.samplers == {} and generation._seeds == {}
    with pytest.raises(ValueError, match="2 prompts and 1 options"):
        generation.add(ids[:2], [0, 1], None, [options[0]])
    with pytest.raises(ValueError, match="one seed per prompt when sampling"):
        generation.add(ids[:2], [0, 1], [None, None], options[:2])


def test_prompts_are_prefilled_in_groups_of_near_lengths():
    # 3 + 2 + 2 positions padded to 9 stay within 1.3x; 100 + 90 padded to 200 too.
    assert length_groups([3, 100, 2, 90, 2, 0], slack=1.3, spare=0) == \
        [[1, 3], [0, 2, 4], [5]]
    assert length_groups([3, 100, 2, 90, 2, 0], slack=1.25, spare=0) == \
        [[1, 3], [0, 2], [4], [5]]
    # 128 spare positions: the 3 joins the long ones (300 for 193), the 2 would not (400).
    assert length_groups([3, 100, 2, 90, 2, 0], slack=1.25, spare=128) == \
        [[1, 3, 0], [2, 4, 5]]
    assert length_groups([5], slack=1.0, spare=0) == [[0]] and length_groups([]) == []


def test_groups_prefilled_apart_give_what_each_gives_alone(generator, monkeypatch):
    """Every length of its own (no slack): each group's pass writes its own rows."""
    monkeypatch.setattr(continuous_generation, "PREFILL_SLACK", 1.0)
    monkeypatch.setattr(continuous_generation, "PREFILL_SPARE", 0)
    passes = []
    prefill = generator.model.prefill
    monkeypatch.setattr(generator.model, "prefill",
                        lambda prompt, *args, **kw: passes.append(prompt.shape) or
                        prefill(prompt, *args, **kw))
    options = GenerateOptions(max_new_tokens=10)
    found, _ = run_continuously(ContinuousGeneration(generator, options), generator, PROMPTS,
                                None, [0, 0, 0, 0, 0, 2, 2, 2])
    assert len(passes) >= 5                # two joins, a pass for each length
    assert found == [generator.generate([p], options)[0] for p in PROMPTS]


def test_long_prompts_joining_early_slots_and_relayouts(tokenizer):
    """Prompts longer than the slots written so far shift the running rows; rows that
    run to the context's end force relayouts; every one still gets its own text."""
    generator = _generator(tokenizer, max_positions=24)
    long = "el perro grande come"
    prompts = ["uno", long, "dos", long + " rojo", "", "casa grande"] * 2
    options = GenerateOptions(max_new_tokens=30)        # more than the context leaves
    joins = [0, 1, 1, 2, 9, 9, 10, 11, 30, 31, 31, 45]
    generation = ContinuousGeneration(generator, options)
    found, steps = run_continuously(generation, generator, prompts, None, joins)
    assert found == [generator.generate([p], options)[0] for p in prompts]
    assert steps > 40 and generation.slot < 2 * 24 + 8     # slots stay bounded


def test_float32_steps_read_each_rows_own_slots_through_the_kernel(generator, monkeypatch):
    """Where the one-query kernel is built, a float32 step reads each row's own slots
    (row runs), not the window from the oldest row on under a mask; still as alone."""
    from transduce.attention import one_query
    from transduce.model.decoder_step import DecoderStep

    if not one_query.available():
        pytest.skip("the one-query kernel cannot be built here")
    runs, step = [], DecoderStep.__call__

    def recorded(self, *args, row_runs=None, **kwargs):
        runs.append(row_runs)
        return step(self, *args, row_runs=row_runs, **kwargs)

    monkeypatch.setattr(DecoderStep, "__call__", recorded)
    options = GenerateOptions(max_new_tokens=8)
    found, _ = run_continuously(ContinuousGeneration(generator, options), generator,
                                PROMPTS[:5], None, [0, 0, 2, 3, 3])
    assert found == [generator.generate([p], options)[0] for p in PROMPTS[:5]]
    assert any(r is not None and len(r) > 1 for r in runs)     # rows of several starts


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "top_k": 20, "seed": 3}])
def test_a_sliding_window_is_a_band_of_slots(tokenizer, settings, monkeypatch):
    """Mistral's attention: a window of 3 keys slides over prompts and outputs longer
    than it. Each row reads its own slots within the window, through the one-query
    kernel where it is built (row runs from the window's first slot) and under a mask
    otherwise (bfloat16); each gets what it gets alone through the window's own cache."""
    from transduce.attention import one_query
    from transduce.model.decoder_step import DecoderStep

    runs, step = [], DecoderStep.__call__
    monkeypatch.setattr(DecoderStep, "__call__", lambda self, *args, row_runs=None, **kw:
                        runs.append(row_runs) or step(self, *args, row_runs=row_runs, **kw))
    options = GenerateOptions(max_new_tokens=16, **settings)
    seeds = None if options.greedy else prompt_seeds(options.seed, len(PROMPTS))
    for dtype in ("float32", "bfloat16"):
        generator = _generator(tokenizer, dtype, attention_type="sliding", attention_window=3)
        assert supports(generator)
        generation = ContinuousGeneration(generator, options)
        found, _ = run_continuously(generation, generator, PROMPTS, seeds,
                                    [0, 0, 1, 4, 4, 9, 12, 13])
        alone = generated_alone(generator, options, seeds)
        assert found == alone
    whole = _generator(tokenizer).generate(PROMPTS, options, seeds=seeds)
    assert found != whole                              # the window changes the text
    if one_query.available():
        assert any(r is not None and len(r) > 1 for r in runs)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("window", [None, 3])
def test_quantized_caches_generate_as_alone(tokenizer, kv_dtype, window):
    """int8 and int4 keys and values with their scales in the slot buffers (a window's
    too), through joins, leaves and relayouts: each prompt as it is generated alone with
    that cache, greedy and sampled."""
    changes = {} if window is None else {"attention_type": "sliding",
                                         "attention_window": window}
    generator = _generator(tokenizer, kv_dtype=kv_dtype, **changes)
    assert supports(generator)
    for settings in ({}, {"temperature": 0.9, "top_k": 20, "seed": 3}):
        options = GenerateOptions(max_new_tokens=14, **settings)
        seeds = None if options.greedy else prompt_seeds(options.seed, len(PROMPTS))
        generation = ContinuousGeneration(generator, options)
        assert generation.caches[0]._buffers == ("k", "v", "k_scale", "v_scale")
        found, _ = run_continuously(generation, generator, PROMPTS, seeds,
                                    [0, 0, 1, 4, 4, 9, 12, 30])
        alone = generated_alone(generator, options, seeds)
        assert found == alone and any(found)


def test_bfloat16_model_with_float32_cache(tokenizer):
    generator = _generator(tokenizer, dtype="bfloat16", kv_dtype="float32")
    options = GenerateOptions(max_new_tokens=10)
    generation = ContinuousGeneration(generator, options)
    assert generation.caches[0].k.dtype == torch.float32
    found, _ = run_continuously(generation, generator, PROMPTS[:4], None, [0, 0, 2, 5])
    assert found == [generator.generate([p], options)[0] for p in PROMPTS[:4]]


def test_refuses_what_it_cannot_generate(generator, tokenizer):
    with pytest.raises(ValueError, match="beam=2"):
        ContinuousGeneration(generator, GenerateOptions(beam=2))
    linear = _generator(tokenizer, attention_type="linear")
    assert supports(generator) and not supports(linear)
    with pytest.raises(ValueError, match="KV caches of softmax or sliding-window attention"):
        ContinuousGeneration(linear, GenerateOptions())
    # Sliding layers among full ones in int8: their band is a float cache's.
    mixed = _generator(tokenizer, kv_dtype="int8", attention_type="sliding",
                       attention_window=3, full_attention_layers=(1,))
    assert not supports(mixed)
    with pytest.raises(ValueError, match="float ones where the two kinds mix"):
        ContinuousGeneration(mixed, GenerateOptions())
    greedy = ContinuousGeneration(generator, GenerateOptions())
    with pytest.raises(ValueError, match="one tag per prompt"):
        greedy.add([[1, 5]], [])
    with pytest.raises(ValueError, match="none when greedy"):
        greedy.add([[1, 5]], ["a"], seeds=[3])
    with pytest.raises(ValueError, match="a prompt of 40 tokens"):
        greedy.add([[5] * 40], ["a"])
    sampled = ContinuousGeneration(generator, GenerateOptions(temperature=1.0))
    with pytest.raises(ValueError, match="one seed per prompt"):
        sampled.add([[1, 5]], ["a"])
    assert greedy.running == 0 and greedy.step() == []


def test_done_rows_free_their_generators(generator):
    options = GenerateOptions(max_new_tokens=4, temperature=1.0)
    generation = ContinuousGeneration(generator, options)
    generation.add(generator.encode(PROMPTS[:3]), [0, 1, 2], [5, 6, 7])
    while generation.running:
        generation.step()
    assert generation.samplers == {} and generation._seeds == {}


@pytest.mark.parametrize("settings,positions", [
    ({}, {}), ({"temperature": 0.9, "top_k": 20, "seed": 3}, {}),
    ({}, {"positional": "rotary", "local_rope_base": 100.0}),
    ({}, {"positional": "rotary", "attention_softcap": 5.0})])
def test_sliding_layers_among_full_ones_keep_their_band(tokenizer, settings, positions,
                                                        monkeypatch):
    """Gemma's layers: a window of 3 keys on two layers of three, the middle one full
    (rotary positions with a base of their own on the sliding layers, as Gemma 3's; or
    Gemma 2's capped scores), over prompts and outputs longer than the window. The
    sliding layers' caches keep their band; where the one-query kernel is built, a
    step of rows of several starts reads each row's own slots, from its first or the
    band's (the written-out step's row runs; a capped layer's by a call per run), else
    every layer reads from the oldest row's first slot under a mask. Each prompt gets
    what it gets alone (its window's own caches and plain ones)."""
    from transduce.attention import one_query
    from transduce.model.decoder_step import DecoderStep

    runs, step = [], DecoderStep.__call__
    monkeypatch.setattr(DecoderStep, "__call__", lambda self, *args, row_runs=None, **kw:
                        runs.append(row_runs) or step(self, *args, row_runs=row_runs, **kw))
    options = GenerateOptions(max_new_tokens=16, **settings)
    seeds = None if options.greedy else prompt_seeds(options.seed, len(PROMPTS))
    generator = _generator(tokenizer, num_decoder_layers=3, attention_type="sliding",
                           attention_window=3, full_attention_layers=(1,), **positions)
    assert supports(generator)
    generation = ContinuousGeneration(generator, options)
    found, _ = run_continuously(generation, generator, PROMPTS, seeds,
                                [0, 0, 1, 4, 4, 9, 12, 13])
    alone = generated_alone(generator, options, seeds)
    assert found == alone and any(found)
    assert {type(cache).__name__ for cache in generation.caches} == {"BandedKVCache",
                                                                    "KVCache"}
    if one_query.available():
        assert any(r is not None and len(r) > 1 for r in runs)   # rows of several starts
        assert any(r is not None and len(r) == 1 for r in runs)   # and of one start too
    if not positions:                                  # the full layer counts
        windowed = _generator(tokenizer, num_decoder_layers=3, attention_type="sliding",
                              attention_window=3)
        assert found != windowed.generate(PROMPTS, options, seeds=seeds)
