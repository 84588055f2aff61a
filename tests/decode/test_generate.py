"""Generation from prompts: batched equals alone, streaming equals the whole text, stop
strings and max_new_tokens are honoured exactly, bad prompts and options are refused."""

import json
import subprocess
import sys
import warnings

import pytest
import torch

from transduce import checkpoint
from transduce.attention import SlidingWindowAttention
from transduce.cli import build_parser, main
from transduce.config import ConfigError, preset
from transduce.data.tokenizer import Tokenizer
from transduce.decode import options as options_module
from transduce.decode import sampling
from transduce.decode.generate import Continuation, Generator, PromptError, prompt_seeds, \
    with_bos
from transduce.decode.options import GenerateOptions
from transduce.decode.sampling import Sampler, filter_logits, exponential_race, \
    penalize_repetition
from transduce.errors import TransduceWarning
from transduce.model import build_model
from transduce.model import int8 as int8_module
from transduce.model import int8_rows, int8_vnni
from transduce.model.int8_rows import Int8RowsLinear
from transduce.model.int8_vnni import Int8VnniLinear
from transduce.runtime import cpu_flags
from tests.environment import subprocess_env
from tests.model.test_int8_rows import INT8_LAYERS

PROMPTS = ["uno dos", "el perro grande come", "casa", "tres gato rojo rojo el casa perro"]


@pytest.fixture(scope="module")
def model(tiny_corpus):
    torch.manual_seed(0)
    vocab = Tokenizer(tiny_corpus / "spm.model").vocab_size
    return build_model(preset("gpt-tiny", src_vocab_size=vocab, tgt_vocab_size=vocab,
                              max_positions=64)).eval()


@pytest.fixture(scope="module")
def generator(model, tiny_corpus):
    return Generator(model, Tokenizer(tiny_corpus / "spm.model"))


@pytest.fixture(scope="module")
def saved_model(model, tiny_corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "model"
    checkpoint.save(path, model, None, tiny_corpus / "spm.model")
    return path


@pytest.mark.skipif(not int8_module.int8_available(), reason="no oneDNN int8 ops")
def test_auto_dtype_on_amx_picks_by_the_language_models_size(model, generator, monkeypatch):
    monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    small = Generator(model, generator.tokenizer, dtype="auto")
    assert next(small.model.parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(options_module, "AMX_INT8_LM_PARAMETERS", model.num_parameters())
    large = Generator(model, generator.tokenizer, dtype="auto")
    assert any(isinstance(m, INT8_LAYERS) for m in large.model.modules())
    assert large.generate(PROMPTS[:1], max_new_tokens=4)[0] == \
        Generator(model, generator.tokenizer, dtype="int8").generate(PROMPTS[:1],
                                                                     max_new_tokens=4)[0]


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "seed": 4, "batch_sentences": 1},
                                      {"kv_dtype": "int8"}, {"kv_dtype": "int4"},
                                      {"repetition_penalty": 1.5}])
def test_batched_prompts_equal_prompts_alone(model, generator, settings):
    settings = dict(settings)
    kv_dtype = settings.pop("kv_dtype", None)
    if kv_dtype:
        generator = Generator(model, generator.tokenizer, kv_dtype=kv_dtype)
    together = generator.generate(PROMPTS, max_new_tokens=12, **settings)
    seeds = prompt_seeds(settings.get("seed"), len(PROMPTS))     # sampling: each its own
    alone = [generator.generate([p], max_new_tokens=12, seeds=[seed], **settings)[0]
             for p, seed in zip(PROMPTS, seeds)]
    assert together == alone
    assert len(together) == len(PROMPTS) and any(together)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_a_sliding_window_in_int8_or_int4_batches_prompts_as_alone(tiny_corpus, kv_dtype):
    """A window of 3 keys held quantized, sliding over left-padded prompts and outputs
    longer than it: each prompt as alone (int8: most texts the float window's; this
    random model's near ties turn under int4's 16 levels), and its memory the window's
    whatever the length."""
    torch.manual_seed(0)
    tokenizer = Tokenizer(tiny_corpus / "spm.model")
    sliding = build_model(preset("gpt-tiny", src_vocab_size=tokenizer.vocab_size,
                                 tgt_vocab_size=tokenizer.vocab_size, max_positions=64,
                                 attention_type="sliding", attention_window=3)).eval()
    generator = Generator(sliding, tokenizer, kv_dtype=kv_dtype)
    together = generator.generate(PROMPTS, max_new_tokens=16)
    assert together == [generator.generate([p], max_new_tokens=16)[0] for p in PROMPTS]
    floats = Generator(sliding, tokenizer).generate(PROMPTS, max_new_tokens=16)
    same = sum(a == b for a, b in zip(together, floats))
    assert any(together) and (kv_dtype == "int4" or same >= len(PROMPTS) // 2)
    state = generator.model.prefill(torch.tensor([[5, 6, 7, 8, 9]]), 40,
                                    cache_dtype=getattr(torch, kv_dtype))
    sizes = {state.caches[0].nbytes}
    for token in range(10, 30):
        generator.model.decode_step(torch.tensor([[token]]), state)
        sizes.add(state.caches[0].nbytes)
    assert sizes == {SlidingWindowAttention(3).cache_bytes(
        1, 40, sliding.config.kv_heads, sliding.config.head_dim, getattr(torch, kv_dtype))[0]}
    assert state.caches[0].held == 3


def test_each_prompt_samples_from_its_own_seed(generator, monkeypatch):
    """A prompt given twice draws two samples; prompt i draws from prompt_seeds(seed)[i]
    whatever shares its batch; a given list of seeds is checked."""
    settings = {"temperature": 1.0, "max_new_tokens": 10}
    prompts = ["uno dos"] * 3 + ["casa"]
    texts = generator.generate(prompts, seed=9, **settings)
    assert len(set(texts[:3])) == 3
    seeds = prompt_seeds(9, len(prompts))
    assert seeds[0] == 9 and len(set(seeds)) == len(seeds)
    alone = [generator.generate([p], seeds=[s], **settings)[0] for p, s in zip(prompts, seeds)]
    assert texts == alone == generator.generate(prompts, seed=9, batch_sentences=1, **settings)
    # Unseeded: a fresh base seed, mixed for each prompt as a given one is (a draw from
    # the system's entropy, here made 9, so that the check cannot fail by chance).
    monkeypatch.setattr(sampling.secrets, "randbits", lambda bits: 9)
    assert generator.generate(prompts, **settings) == texts
    with pytest.raises(ConfigError, match="seeds: give one integer"):
        generator.generate(prompts, seeds=[1, 2], **settings)


def test_seeded_sampling_repeats_and_differs_across_seeds(generator):
    first = generator.generate(PROMPTS, max_new_tokens=10, temperature=1.0, seed=1)
    assert generator.generate(PROMPTS, max_new_tokens=10, temperature=1.0, seed=1) == first
    assert generator.generate(PROMPTS, max_new_tokens=10, temperature=1.0, seed=2) != first


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.8, "seed": 3}, {"stop": ("e",)}])
def test_stream_joined_equals_generate(generator, settings):
    for prompt in PROMPTS:
        pieces = list(generator.stream(prompt, max_new_tokens=15, **settings))
        assert "".join(pieces) == generator.generate([prompt], max_new_tokens=15, **settings)[0]
        assert all(pieces)


def test_max_new_tokens_is_exact(generator):
    options = GenerateOptions(max_new_tokens=7)
    prompt, mask, max_new, rows = generator._prepare(generator.encode(PROMPTS), options)
    for _ in generator._steps(prompt, mask, rows, max_new, None, None):
        pass
    for row in rows:   # 7 tokens, or fewer only when one of them was eos
        assert len(row.tokens) == 7 or len(row.tokens) < 7 and row.finished


def test_stop_strings_cut_the_text_where_they_first_appear(generator):
    free = generator.generate(PROMPTS, max_new_tokens=20)
    stop = next(text for text in free if len(text) > 6)[3:5]
    cut = generator.generate(PROMPTS, max_new_tokens=20, stop=(stop, "zzz"))
    for whole, text in zip(free, cut):
        assert text == whole.split(stop)[0]
        assert stop not in text


def test_beam_search_generation(generator):
    texts = generator.generate(PROMPTS, max_new_tokens=8, beam=3)
    alone = [generator.generate([p], max_new_tokens=8, beam=3)[0] for p in PROMPTS]
    assert texts == alone
    with pytest.raises(ConfigError, match="streaming"):
        list(generator.stream(PROMPTS[0], beam=3))


def test_continuation_streams_whole_words_and_holds_back_stop_prefixes():
    class Bytes:   # each token is one UTF-8 byte
        eos_id = 0

        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    row = Continuation(Bytes(), ("END",))
    taken = []
    for byte in "héllo wörld E".encode():
        row.add(byte)
        taken.append(row.take())
    assert "".join(taken) == "héllo wörld "    # "E" may still grow into a word, or "END"
    assert all("\ufffd" not in piece for piece in taken)
    assert taken.index("héllo ") == len("héllo ".encode()) - 1
    row.add(ord("N"))
    assert row.take() == ""                     # "EN" could still end in "END"
    row.add(ord("X"))
    assert row.take() == ""                     # a word still growing
    row.add(ord(" "))
    assert row.take() == "ENX "
    for byte in b"ab END cd":
        row.add(byte)
    assert row.finished and row.text == "héllo wörld ENX ab "
    assert row.take() == "ab "


def test_more_new_tokens_than_the_context_holds_is_warned_about(generator):
    prompt_tokens = len(generator.encode(["uno dos"])[0])
    with pytest.warns(TransduceWarning, match=f"max_new_tokens=100: the model reads 64 positions "
                                              f"and the longest prompt takes {prompt_tokens}, so "
                                              f"its continuation stops after {64 - prompt_tokens}"):
        generator.generate(["uno dos"], max_new_tokens=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generator.generate(["uno dos"], max_new_tokens=64 - prompt_tokens)


@pytest.mark.parametrize("settings", [{}, {"temperature": 1.5, "seed": 2}, {"beam": 3}])
def test_near_the_context_end_each_prompt_gets_the_tokens_it_gets_alone(generator, settings):
    """A long prompt leaves few positions; batched with it, a short one still runs to
    max_new_tokens, as alone (it used to stop where the long one had to)."""
    prompts = ["uno", "el perro grande come " * 2]
    lengths = [len(ids) for ids in generator.encode(prompts)]
    assert lengths[1] > 64 - 40 > lengths[0]
    options = GenerateOptions(max_new_tokens=40, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TransduceWarning)
        rows = generator._generate_batch(generator.encode(prompts), options)
        alone = [generator._generate_batch(generator.encode([p]), options)[0] for p in prompts]
    assert [row.tokens for row in rows] == [row.tokens for row in alone]
    assert len(rows[1].tokens) <= 64 - lengths[1] < len(rows[0].tokens)


def test_too_long_prompts_are_refused_by_number(generator):
    with pytest.raises(PromptError, match="prompt 2: .* tokens, but the model reads 64"):
        generator.generate(["uno", "uno " * 80])


def test_an_empty_prompt_generates_from_bos_alone(model, generator):
    """The greedy continuation of [bos], step by step with the whole model (no cache),
    batched with other prompts or alone."""
    tokens = torch.tensor([[generator.tokenizer.bos_id]])
    with torch.no_grad():
        for _ in range(10):
            chosen = model(tokens)[:, -1].argmax(-1, keepdim=True)
            if chosen.item() == generator.tokenizer.eos_id:
                break
            tokens = torch.cat([tokens, chosen], dim=1)
    expected = generator.tokenizer.decode(tokens[0, 1:].tolist())
    assert generator.generate([""], max_new_tokens=10) == [expected]
    assert generator.generate(["uno", ""], max_new_tokens=10)[1] == expected


def test_with_bos_starts_an_empty_prompt_with_bos_whatever_the_tokenizer_prepends():
    class Unprefixed:           # GPT-2's tokenizer: no bos before a prompt
        prepend_bos, bos_id = False, 7

    assert with_bos([], Unprefixed()) == [7] and with_bos([4, 5], Unprefixed()) == [4, 5]
    Unprefixed.prepend_bos = True
    assert with_bos([], Unprefixed()) == [7] and with_bos([4, 5], Unprefixed()) == [7, 4, 5]


@pytest.mark.parametrize("settings,option", [
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"temperature": -1.0}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": ("",)}, "stop"),
    ({"beam": 2, "temperature": 0.5}, "beam"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"), ({"min_p": 1.5}, "min_p=1.5: must be"),
    ({"min_p": -0.1}, "min_p")])
def test_out_of_range_options_are_refused_naming_them(generator, settings, option):
    with pytest.raises(ConfigError, match=option):
        generator.generate(PROMPTS, **settings)


def test_a_translation_model_is_refused(tiny_corpus):
    config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300)
    with pytest.raises(ConfigError, match="decoder-only"):
        Generator(build_model(config), Tokenizer(tiny_corpus / "spm.model"))


def test_filtering_and_penalty():
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()
    probs = logits.softmax(-1)[0]
    kept = filter_logits(logits, 0, float(probs[0] + 0.01))
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    seen = torch.tensor([[True, False, False, True]])
    assert penalize_repetition(logits, seen, 2.0).tolist() == [[1.5, 2.0, 1.0, -2.0]]
    with pytest.raises(ConfigError, match="top_p"):
        Sampler(top_p=0.0)


@pytest.mark.parametrize("vocab", [50, 5000])
@pytest.mark.parametrize("top_k,top_p,min_p", [
    (0, 0.9, 0.0), (0, 0.5, 0.0), (0, 0.999, 0.0), (20, 0.8, 0.0), (3000, 0.95, 0.0),
    (0, 1.0, 0.05), (0, 1.0, 0.3), (0, 0.9, 0.1), (40, 0.95, 0.02)])
def test_top_k_top_p_and_min_p_keep_the_tokens_transformers_keeps(vocab, top_k, top_p, min_p):
    """transformers' TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper as the
    reference, on rows from peaked to flat: nuclei of one token, of a few dozen (found
    among the likeliest 64), of hundreds (1,024) and of thousands (every token sorted),
    in one batch."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    torch.manual_seed(vocab)
    spread = torch.tensor([12.0, 6.0, 3.0, 1.5, 0.5, 0.1, 0.01])[:, None]
    logits = torch.randn(len(spread), vocab) * spread                        # (7, V)
    want = logits
    if top_k:
        want = TopKLogitsWarper(min(top_k, vocab))(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    if min_p:
        want = MinPLogitsWarper(min_p)(None, want)
    kept = filter_logits(logits, top_k, top_p, min_p)
    assert torch.equal(kept.isfinite(), want.isfinite())
    assert torch.equal(kept[kept.isfinite()], logits[kept.isfinite()])
    sizes = want.isfinite().sum(dim=-1)
    if vocab == 5000 and not top_k and top_p == 0.9 and not min_p:   # every nucleus() path
        assert sizes.min() == 1 and ((64 < sizes) & (sizes <= 1024)).any() and sizes.max() > 1024


def test_a_top_p_or_penalty_at_the_edge_of_float32_still_samples(generator):
    """top_p 1e-300 rounds to 0 in float32: the most likely token alone is left, so
    sampling is greedy search. A penalty of 1e-40 would divide logits into inf."""
    greedy = generator.generate(PROMPTS, max_new_tokens=6)
    assert generator.generate(PROMPTS, max_new_tokens=6, temperature=1.0, top_p=1e-300,
                              seed=3) == greedy
    for penalty in (1e-40, 1e40):
        texts = generator.generate(PROMPTS, max_new_tokens=6, temperature=1.0, seed=3,
                                   repetition_penalty=penalty)
        assert len(texts) == len(PROMPTS)
    logits = torch.tensor([[3.0, -2.0]])
    assert penalize_repetition(logits, torch.tensor([[True, True]]), 1e-40).isfinite().all()


def test_cli_generates_one_line_per_prompt(saved_model, capsys):
    assert main(["generate", "--model", str(saved_model), "--prompt", "uno dos",
                 "--prompt", "casa", "--max-new-tokens", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert main(["generate", "--model", str(saved_model), "--prompt", "casa", "--stream",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.splitlines() == lines[1:]
    assert main(["generate", "--model", str(saved_model), "--prompt", "casa", "--temperature",
                 "1", "--seed", str(2**40), "--max-new-tokens", "2"]) == 0   # 63-bit seeds


@pytest.mark.skipif(not int8_module.int8_available(), reason="no oneDNN int8 ops")
def test_the_cli_decodes_in_the_hardware_s_type_unless_told(saved_model, model, generator,
                                                            monkeypatch, capsys):
    """generate takes --dtype as translate and serve do: auto by default (int8 on a CPU
    with VNNI), and a type named is the type decoded in; chat has the same option."""
    monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)      # every product in int8
    loaded, load = [], Generator.load

    def recording_load(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(Generator, "load", staticmethod(recording_load))
    int8 = Generator(model, generator.tokenizer, dtype="int8")
    for given, expected in (([], int8), (["--dtype", "float32"], generator)):
        assert main(["generate", "--model", str(saved_model), "--max-new-tokens", "8",
                     "--prompt", PROMPTS[1], *given]) == 0
        assert any(isinstance(m, INT8_LAYERS) for m in loaded[-1].model.modules()) == \
            (expected is int8)
        assert capsys.readouterr().out == \
            expected.generate([PROMPTS[1]], max_new_tokens=8)[0] + "\n"
    chat = build_parser().parse_args(["chat", "--model", str(saved_model)])
    assert chat.dtype == "auto"


def _run_cli(args, stdin: bytes):
    return subprocess.run([sys.executable, "-m", "transduce", *args], input=stdin,
                          capture_output=True, env=subprocess_env())


def test_cli_draws_prompt_k_from_the_kth_seed_however_it_reads_them(saved_model):
    """Sampled prompts from standard input (read in batches of 64 lines), from --prompt
    and streamed give the same lines; the same prompt twice gives two samples."""
    sampled = ["--max-new-tokens", "4", "--temperature", "1", "--seed", "3"]
    prompts = ["uno dos"] * 66
    piped = _run_cli(["generate", "--model", str(saved_model), *sampled],
                     ("\n".join(prompts) + "\n").encode())
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.decode().split("\n")[:-1]     # not splitlines: \x1c is a break
    assert len(lines) == 66 and len(set(lines)) > 60
    given = [arg for prompt in prompts[:3] for arg in ("--prompt", prompt)]
    streamed = _run_cli(["generate", "--model", str(saved_model), *sampled, *given,
                         "--stream"], b"")
    assert streamed.stdout.decode().split("\n")[:-1] == lines[:3]


def test_cli_refuses_bad_stdin_and_bad_options(saved_model):
    result = _run_cli(["generate", "--model", str(saved_model)], b"uno\n\xff\xfe\n")
    assert result.returncode == 1 and b"<stdin>:2: invalid UTF-8" in result.stderr
    result = _run_cli(["generate", "--model", str(saved_model), "--max-new-tokens", "3"],
                      b"uno\n\ncasa\n")
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 3   # one per prompt
    result = _run_cli(["generate", "--model", str(saved_model), "--top-p", "0"], b"uno\n")
    assert result.returncode == 2 and b"--top-p" in result.stderr
    assert b"Traceback" not in result.stderr


@pytest.mark.skipif(not int8_module.int8_available(), reason="no oneDNN int8 ops in this build")
@pytest.mark.parametrize("layer", INT8_LAYERS, ids=lambda layer: layer.__name__)
def test_int8_generation_is_the_same_batched_and_alone(model, generator, monkeypatch, layer):
    """Left-padded prompts side by side: the int8 products quantize each row alone, with
    oneDNN's kernel, the rows kernel (model/int8_rows.py) and the VNNI kernel
    (model/int8_vnni.py)."""
    rows, vnni = layer is Int8RowsLinear, layer is Int8VnniLinear
    if rows and not ("avx2" in cpu_flags() and int8_rows.KERNEL.available()):
        pytest.skip("the int8 rows kernel needs an x86 CPU with AVX2 and a compiler")
    if vnni and not int8_vnni.available():
        pytest.skip("the int8 VNNI kernel needs AVX512-VNNI and a compiler")
    monkeypatch.setattr(int8_rows, "preferred", lambda: rows)
    monkeypatch.setattr(int8_vnni, "available", lambda: vnni)
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)      # every product in int8
    int8 = Generator(model, generator.tokenizer, dtype="int8")
    assert any(isinstance(m, layer) for m in int8.model.modules())
    together = int8.generate(PROMPTS, max_new_tokens=12)
    assert together == [int8.generate([p], max_new_tokens=12)[0] for p in PROMPTS]
    assert any(together)


def test_the_packed_copy_generates_what_the_model_does(model, generator):
    """The Generator decodes with a copy whose Linear weights are packed for oneDNN; its
    logits are the model's to float32 rounding."""
    assert generator.model is not model
    tokens = torch.randint(4, model.config.tgt_vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(generator.model(tokens), model(tokens), rtol=0, atol=1e-5)


def test_the_exponential_race_draws_each_token_with_its_probability():
    """Drawn tokens follow the distribution (against the exact probabilities, with a
    bound a biased draw breaks), tokens of probability 0 are never drawn, even against
    an arrival of 0, and a token of probability 1 always is."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.1] * 5 + [0.5]])
    draws = 100_000
    generator = torch.Generator().manual_seed(0)
    for row in probs:
        uniforms = torch.rand(draws, len(row), generator=generator)
        tokens = exponential_race(row.expand(draws, -1), uniforms)
        frequencies = torch.bincount(tokens, minlength=len(row)).double() / draws
        # 5 standard deviations of a frequency: sqrt(p (1 - p) / n) <= 0.0016 here
        torch.testing.assert_close(frequencies, row.double(), rtol=0, atol=0.008)
        assert (frequencies[row == 0] == 0).all()
    certain = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert exponential_race(certain, torch.zeros(1, 4)).tolist() == [2]
    assert exponential_race(certain, torch.tensor([[0.0, 0.3, 0.99, 0.0]])).tolist() == [2]


def test_a_tiny_temperature_samples_the_most_likely_token():
    # 1e-300 rounds to 0 in float32: dividing by it gave 0 / 0 = nan (found by the
    # server's fuzz); now it is greedy.
    logits = torch.tensor([[0.5, 3.0, -1.0, 3.0 - 1e-3], [-2.0, -9.0, -1.0, float("-inf")]])
    for temperature in (1e-300, 2.8e-290, 1e-40):
        drawn = Sampler(temperature=temperature, seed=0)(logits)
        assert drawn.tolist() == [1, 2]


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "seed": 4}])
def test_stream_batch_joined_equals_generate(generator, settings):
    pieces = [[] for _ in PROMPTS]
    for step in generator.stream_batch(PROMPTS, max_new_tokens=20, **settings):
        assert len(step) == len(PROMPTS)
        for row, text in zip(pieces, step):
            row.append(text)
    assert ["".join(row) for row in pieces] == \
        generator.generate(PROMPTS, max_new_tokens=20, **settings)
    with pytest.raises(ConfigError, match="beam"):
        next(generator.stream_batch(PROMPTS, beam=2))


def test_translate_refuses_a_language_model_naming_generate(saved_model, tmp_path, capsys):
    """(`attention` draws a language model's continuation: tests/test_attention_maps.py.)"""
    source = tmp_path / "in.txt"
    source.write_text("uno dos\n")
    assert main(["translate", "--model", str(saved_model), "--input", str(source)]) == 2
    assert "arch='decoder': a language model, use generate" in capsys.readouterr().err


def test_load_generates_with_the_model_it_read_as_a_copy_would(model, generator, saved_model):
    """Generator.load hands its own model over (in_place): one copy in memory, not two."""
    loaded = Generator.load(saved_model)
    assert loaded.model.source_parameters == model.num_parameters()
    assert loaded.generate(PROMPTS, max_new_tokens=8) == generator.generate(PROMPTS,
                                                                            max_new_tokens=8)
    given = build_model(model.config)
    assert Generator(given, generator.tokenizer, in_place=True).model is given


def test_min_p_samples_only_tokens_at_least_min_p_as_likely_as_the_likeliest(generator):
    """Every sampled token, checked against a full causal pass's logits at its place:
    at T 1.5 without min_p some tokens are far below the likeliest; with min_p 0.3 none
    is below 0.3 times it."""
    def lowest_ratio(**settings):
        rows = generator.generate_rows(PROMPTS, max_new_tokens=12, temperature=1.5, seed=9,
                                       **settings)
        ratios = []
        with torch.inference_mode():
            for prompt, row in zip(generator.encode(PROMPTS), rows):
                sequence = torch.tensor([prompt + row.tokens])
                logits = generator.model(sequence)[0, len(prompt) - 1:-1] / 1.5   # (N, V)
                chosen = logits.gather(1, torch.tensor(row.tokens)[:, None])[:, 0]
                ratios.append((chosen - logits.amax(dim=-1)).exp().min())
        return float(min(ratios))

    assert lowest_ratio() < 0.1
    assert lowest_ratio(min_p=0.3) >= 0.3 - 1e-4


def test_the_cli_takes_min_p_and_refuses_one_out_of_range(saved_model, generator, capsys):
    command = ["generate", "--model", str(saved_model), "--prompt", "casa", "--temperature",
               "1.5", "--seed", "4", "--max-new-tokens", "6"]
    assert main([*command, "--min-p", "0.3"]) == 0
    want = generator.generate(["casa"], max_new_tokens=6, temperature=1.5, seed=4, min_p=0.3)
    assert capsys.readouterr().out == want[0] + "\n"
    assert main([*command, "--min-p", "1.5"]) == 2
    assert "min_p=1.5: must be in [0, 1]" in capsys.readouterr().err


def test_the_cli_generates_json_of_a_schema_file_and_refuses_a_bad_one(saved_model, generator,
                                                                      tmp_path, capsys):
    """--json-schema FILE and --json as GenerateOptions.json_schema; a file that is no JSON
    is named."""
    from transduce.cli.generate import one_line

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["generate", "--model", str(saved_model), "--prompt", "casa", "--dtype",
                 "float32", "--json-schema", str(tmp_path / "schema.json"),
                 "--max-new-tokens", "12"]) == 0
    expected = generator.generate(["casa"], max_new_tokens=12, json_schema=schema)[0]
    assert capsys.readouterr().out.splitlines() == [one_line(expected)]
    assert expected.lstrip().startswith("{")
    assert main(["generate", "--model", str(saved_model), "--prompt", "casa", "--dtype",
                 "float32", "--json", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.splitlines() == [one_line(generator.generate(
        ["casa"], max_new_tokens=12, json_schema={"type": "object"})[0])]
    result = _run_cli(["generate", "--model", str(saved_model), "--json-schema",
                       str(tmp_path / "bad.json")], b"uno\n")
    assert result.returncode == 2 and b"bad.json: not a readable JSON file" in result.stderr
    result = _run_cli(["generate", "--model", str(saved_model), "--json", "--json-schema",
                       str(tmp_path / "schema.json")], b"uno\n")
    assert result.returncode != 0 and b"--json and --json-schema" in result.stderr
    assert b"Traceback" not in result.stderr
