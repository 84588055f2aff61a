"""The frequency and presence penalties and the logit bias (decode/penalties.py), with
the repetition penalty they share buffers with: the formula against a float64
reference, greedy generation against a loop that applies it to full causal passes, a
prompt batched as alone, bans and forced tokens, and what the options refuse."""

import pytest
import torch

from transduce.cli import main
from transduce.config import ConfigError, preset
from transduce.data.tokenizer import Tokenizer
from transduce.decode.generate import Generator
from transduce.decode.options import GenerateOptions
from transduce.decode.penalties import Penalties
from transduce.model import build_model

PROMPTS = ["uno dos", "el perro grande come", "casa", "tres gato rojo rojo el casa perro"]


def language_model(tokenizer):
    torch.manual_seed(0)
    return build_model(preset("gpt-tiny", src_vocab_size=tokenizer.vocab_size,
                              tgt_vocab_size=tokenizer.vocab_size, max_positions=64)).eval()


@pytest.fixture(scope="module")
def generator(tiny_corpus):
    tokenizer = Tokenizer(tiny_corpus / "spm.model")
    return Generator(language_model(tokenizer), tokenizer)


def reference(logits, prompt, output, options):
    """The penalized logits of one row in float64: prompt and output token lists."""
    logits = logits.double().clone()
    for token in set(prompt) | set(output):
        value = logits[token]
        penalty = options.repetition_penalty
        logits[token] = value / penalty if value > 0 else value * penalty
    for token in set(output):
        logits[token] -= options.frequency_penalty * output.count(token) \
            + options.presence_penalty
    for token, bias in options.logit_bias or ():
        logits[token] += bias
    return logits


def test_the_formula_is_the_float64_reference_s_row_by_row():
    """Rows of their own settings (one with none) after prompts and outputs of repeated
    tokens; recorded in steps, then kept in another order, as a running batch does."""
    torch.manual_seed(1)
    vocab = 40
    settings = [GenerateOptions(frequency_penalty=0.8, presence_penalty=-0.3),
                GenerateOptions(repetition_penalty=1.7, logit_bias={3: -100, 7: 2.5}),
                GenerateOptions(),
                GenerateOptions(repetition_penalty=0.6, frequency_penalty=-1.1,
                                presence_penalty=2.0, logit_bias={0: 1e-3})]
    prompts = [[1, 2, 2], [5], [9, 10], [3, 3, 4]]
    penalties = Penalties(4, vocab, "cpu")
    penalties.start(0, prompts, settings)
    outputs = [[] for _ in prompts]
    for _ in range(6):
        tokens = torch.randint(0, 8, (4,))
        penalties.record(tokens)
        for output, token in zip(outputs, tokens.tolist()):
            output.append(token)
    order = torch.tensor([2, 0, 3, 1])
    penalties.select(order)
    logits = torch.randn(4, vocab) * 3
    got = penalties(logits)
    for row, index in enumerate(order.tolist()):
        want = reference(logits[row], prompts[index], outputs[index], settings[index])
        torch.testing.assert_close(got[row].double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("places", [1, 3, 6])
def test_a_drafted_place_is_penalized_as_if_the_draft_before_it_had_been_generated(places):
    """drafted(logits, draft): place i (the last after the whole draft) equals the
    penalties after recording the draft's tokens before it one by one; extend() records
    as record() does."""
    torch.manual_seed(2)
    vocab = 30
    options = GenerateOptions(repetition_penalty=1.6, frequency_penalty=0.7,
                              presence_penalty=-0.4, logit_bias={4: 1.5, 9: -2.0})
    prompt, output, draft = [1, 4, 4], [9, 2, 2], [2, 5, 2, 9, 5]
    penalties = Penalties(1, vocab, "cpu")
    penalties.start(0, [prompt], [options])
    penalties.extend(output)
    logits = torch.randn(places, vocab) * 3
    got = penalties.drafted(logits, draft)
    for place in range(places):
        before = draft[:len(draft) - places + 1 + place]
        want = reference(logits[place], prompt, output + before, options)
        torch.testing.assert_close(got[place].double(), want, rtol=1e-6, atol=1e-5)
        one_by_one = Penalties(1, vocab, "cpu")
        one_by_one.start(0, [prompt], [options])
        for token in output + before:
            one_by_one.record(torch.tensor([token]))
        torch.testing.assert_close(got[place:place + 1], one_by_one(logits[place:place + 1]),
                                   rtol=0, atol=0)
    assert torch.equal(penalties.counts[0].nonzero()[:, 0], torch.tensor([2, 9]))
    assert penalties.counts[0, 2] == 2


@pytest.mark.parametrize("settings", [
    {"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
    {"frequency_penalty": 0.6, "presence_penalty": 0.6, "repetition_penalty": 1.3,
     "logit_bias": {4: 1.5, 12: -3.0}}])
def test_greedy_generation_is_the_reference_loop_s_batched_or_alone(generator, settings):
    """The reference reads every step's logits off a full causal pass of prompt and
    output (no cache) and applies the formula in float64; the Generator's batch of
    left-padded prompts, and each prompt alone, choose the same tokens."""
    options = GenerateOptions(max_new_tokens=12, **settings)
    batched = generator.generate_rows(PROMPTS, options)
    plain = generator.generate_rows(PROMPTS, max_new_tokens=12)
    assert [row.tokens for row in batched] != [row.tokens for row in plain]
    for prompt, row in zip(generator.encode(PROMPTS), batched):
        output = []
        with torch.inference_mode():
            while len(output) < len(row.tokens):
                logits = generator.model(torch.tensor([prompt + output]))[0, -1]
                output.append(int(reference(logits, prompt, output, options).argmax()))
        assert output == row.tokens
    alone = [generator.generate_rows([prompt], options)[0].tokens for prompt in PROMPTS]
    assert alone == [row.tokens for row in batched]


def test_a_bias_of_minus_100_bans_a_token_and_plus_100_forces_it(generator):
    plain = generator.generate_rows(PROMPTS, max_new_tokens=16)
    common = max(set(sum((row.tokens for row in plain), [])),
                 key=lambda t: sum(row.tokens.count(t) for row in plain))
    banned = generator.generate_rows(PROMPTS, max_new_tokens=16, logit_bias={common: -100})
    assert all(common not in row.tokens for row in banned)
    forced = generator.generate_rows(PROMPTS, max_new_tokens=5, temperature=1.0, seed=3,
                                     logit_bias={"11": 100})           # a JSON object's key
    assert all(row.tokens == [11] * 5 for row in forced)
    sampled = generator.generate(PROMPTS, max_new_tokens=16, temperature=0.9, seed=4,
                                 presence_penalty=2.0)
    assert sampled == generator.generate(PROMPTS, max_new_tokens=16, temperature=0.9,
                                         seed=4, presence_penalty=2.0)


@pytest.mark.parametrize("settings,match", [
    ({"frequency_penalty": 2.5}, "frequency_penalty=2.5: must be from -2 to 2"),
    ({"presence_penalty": -3.0}, "presence_penalty=-3.0: must be from -2 to 2"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty=nan: must be a finite"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias: -1 is not a token id"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias: 'x' is not a token id"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\]=101: must be a number from -100 to 100"),
    ({"logit_bias": {5: True}}, r"logit_bias\[5\]=True: must be a number"),
    ({"logit_bias": [5]}, r"logit_bias=\[5\]: must map token ids"),
    ({"logit_bias": "5"}, r"logit_bias='5': must map token ids"),
    ({"beam": 2, "frequency_penalty": 0.5}, "beam search .* no temperature, penalties"),
])
def test_out_of_range_penalties_and_biases_are_refused_naming_them(settings, match):
    with pytest.raises(ConfigError, match=match):
        GenerateOptions(**settings)


def test_a_bias_for_a_token_the_model_lacks_is_refused_before_generating(generator):
    vocab = generator.model.config.tgt_vocab_size
    with pytest.raises(ConfigError, match=f"logit_bias: token {vocab} is not among the "
                                          f"model's {vocab}"):
        generator.generate(PROMPTS, logit_bias={vocab: 1.0, 3: 1.0})
    assert GenerateOptions(logit_bias={}).logit_bias is None
    options = GenerateOptions(logit_bias={"9": -1, 4: 2.5}, frequency_penalty=0.5)
    assert options.logit_bias == ((4, 2.5), (9, -1.0)) and hash(options)   # a batch's key
    assert GenerateOptions.from_dict(options.to_dict()) == options


def test_the_cli_takes_penalties_and_biases_and_refuses_bad_ones(generator, tiny_corpus,
                                                                  tmp_path, capsys):
    from transduce import checkpoint

    checkpoint.save(tmp_path / "lm", language_model(generator.tokenizer), None,
                    tiny_corpus / "spm.model")
    command = ["generate", "--model", str(tmp_path / "lm"), "--prompt", PROMPTS[0],
               "--max-new-tokens", "8"]
    assert main([*command, "--frequency-penalty", "1.5", "--logit-bias", "11=-100",
                 "--logit-bias", "4=2"]) == 0
    want = generator.generate(PROMPTS[:1], max_new_tokens=8, frequency_penalty=1.5,
                              logit_bias={11: -100, 4: 2})
    assert capsys.readouterr().out == want[0] + "\n"
    assert main([*command, "--presence-penalty", "3"]) == 2
    assert "presence_penalty=3.0: must be from -2 to 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*command, "--logit-bias", "eleven"])
    assert "give a token id and a bias, as 50256=-100" in capsys.readouterr().err
