"""Speculative sampling (decode/speculative.py): a drafted token is kept with
probability min(1, p / q) and a rejection draws from max(0, p - q), so every token is
distributed as the model's sampling distribution p given the tokens before it, whatever
the drafts. Checked on the rule alone against exact distributions, with drafts chosen
for certain (prompt lookup) and drawn from a distribution (a draft model); then through
the Generator against a model's own distribution, and for what the options allow."""

import pytest
import torch

from transduce.cli import main
from transduce.config import preset
from transduce.data.tokenizer import Tokenizer
from transduce.decode.draft_model import DraftModel
from transduce.decode.generate import Generator, PromptIds
from transduce.decode.lookup import NgramIndex
from transduce.decode.options import GenerateOptions
from transduce.decode.penalties import Penalties
from transduce.decode.sampling import Sampler
from transduce.decode.speculative import sampled_verified, speculative_steps
from transduce.model import build_model

V = 5          # tokens of the toy distributions
PROMPTS = ["uno dos tres uno dos tres uno", "el perro grande come el perro", "casa",
           "tres gato rojo rojo el casa perro gato rojo"]


def distribution(*weights: float) -> torch.Tensor:
    tensor = torch.tensor(weights, dtype=torch.float32)
    return tensor / tensor.sum()


# The model's distribution of the first token, of the second given the first (row x),
# of the third given the first two (x, y): random, with tokens of probability 0 (what
# top_k and top_p leave out).
RANDOM = torch.Generator().manual_seed(3)
P0 = distribution(0.35, 0.25, 0.2, 0.2, 0.0)
P1 = torch.rand(V, V, generator=RANDOM).pow(2) * (torch.rand(V, V, generator=RANDOM) > 0.25)
P1 = P1 / P1.sum(dim=-1, keepdim=True)
P2 = torch.rand(V, V, V, generator=RANDOM).pow(2)
P2 = P2 / P2.sum(dim=-1, keepdim=True)
# A draft model's: unlike the model's, with mass where the model has none.
Q0 = distribution(0.1, 0.5, 0.05, 0.05, 0.3)
Q1 = torch.rand(V, V, generator=RANDOM) + 0.05
Q1 = Q1 / Q1.sum(dim=-1, keepdim=True)


def exact_pairs() -> torch.Tensor:
    """(V, V): the probability that the first two tokens are (x, y): p0(x) p1(y | x)."""
    return P0[:, None] * P1


def sampled_pairs(trials: int, drafter) -> tuple[torch.Tensor, list[int]]:
    """The frequency of each first two tokens (V, V) over `trials` steps of the rule,
    each drafting two tokens with `drafter(sampler) -> (draft, distributions)`; where a
    step emits one token, the second is drawn as plain sampling would. Also how many
    drafted tokens each step kept."""
    sampler = Sampler(seed=11)
    counts, kept = torch.zeros(V, V), []
    for _ in range(trials):
        draft, distributions = drafter(sampler)
        logits = torch.stack([P0, P1[draft[0]], P2[draft[0], draft[1]]]).log() + 3.0
        tokens = sampled_verified(draft, distributions, logits, sampler, row=0)
        kept.append(len(tokens) - 1)
        if len(tokens) == 1:
            tokens.append(int(sampler.draw(P1[tokens[0]][None], [0])[0]))
        counts[tokens[0], tokens[1]] += 1
    return counts / trials, kept


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


@pytest.mark.parametrize("draft", [[0, 2], [1, 1], [4, 0]])
def test_a_draft_chosen_for_certain_leaves_the_model_s_distribution(draft):
    """A prompt lookup's draft, likely ([0, 2]), unlikely ([1, 1]) or impossible ([4,
    0]: p0 = 0): the first two tokens are distributed as p0(x) p1(y | x) (12,000 steps:
    a total variation of 0.03 at most, where a rejection drawing from p itself gives
    0.24 for [0, 2]), the draft kept with its probability."""
    frequencies, kept = sampled_pairs(12_000, lambda sampler: (draft, None))
    assert total_variation(frequencies, exact_pairs()) < 0.03
    first_kept = sum(k >= 1 for k in kept) / len(kept)
    assert first_kept == pytest.approx(float(P0[draft[0]]), abs=0.015)
    both_kept = sum(k == 2 for k in kept) / len(kept)
    assert both_kept == pytest.approx(float(P0[draft[0]] * P1[draft[0], draft[1]]), abs=0.015)


def test_a_draft_drawn_from_another_distribution_leaves_the_model_s_distribution():
    """A draft model's drafts, drawn from q0 and q1 (mass where the model has none):
    the first two tokens are still distributed as p0(x) p1(y | x) (0.14 off where a
    rejection draws from p itself), and a token is kept with probability sum over x of
    min(p(x), q(x))."""
    def drafter(sampler):
        first = int(sampler.draw(Q0[None], [0])[0])
        second = int(sampler.draw(Q1[first][None], [0])[0])
        return [first, second], torch.stack([Q0, Q1[first]])

    frequencies, kept = sampled_pairs(12_000, drafter)
    assert total_variation(frequencies, exact_pairs()) < 0.03
    first_kept = sum(k >= 1 for k in kept) / len(kept)
    assert first_kept == pytest.approx(float(torch.minimum(P0, Q0).sum()), abs=0.015)


def test_a_draft_drawn_from_the_model_s_own_distribution_is_always_kept():
    sampler = Sampler(seed=4)
    for _ in range(200):
        first = int(sampler.draw(P0[None], [0])[0])
        second = int(sampler.draw(P1[first][None], [0])[0])
        tokens = sampled_verified([first, second], torch.stack([P0, P1[first]]),
                                  torch.stack([P0, P1[first], P2[first, second]]).log(),
                                  sampler, 0)
        assert tokens[:2] == [first, second] and len(tokens) == 3


def test_no_draft_is_plain_sampling():
    frequencies = torch.zeros(V)
    sampler = Sampler(seed=5)
    for _ in range(6000):
        frequencies[sampled_verified([], None, P0[None].log(), sampler, 0)[0]] += 1
    assert total_variation(frequencies / 6000, P0) < 0.02


# --- through the Generator ---------------------------------------------------------

TEMPERATURE, TOP_K = 0.3, 4


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    return Tokenizer(tiny_corpus / "spm.model")


def language_model(tokenizer, noise: float = 0.0):
    """A random gpt-tiny; with noise, a copy of it whose weights are disturbed (a draft
    model that agrees with it now and then)."""
    torch.manual_seed(0)
    model = build_model(preset("gpt-tiny", src_vocab_size=tokenizer.vocab_size,
                               tgt_vocab_size=tokenizer.vocab_size, max_positions=64)).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    return model


def next_distributions(model, prompts: list[list[int]], options: GenerateOptions | None = None,
                       generated: int = 0) -> torch.Tensor:
    """The model's sampling distribution (TEMPERATURE, TOP_K) after each prompt of one
    length: (N, P) -> (N, V); with options, its logits penalized as if the last
    `generated` tokens of each prompt had been generated."""
    with torch.inference_mode():
        ids = torch.tensor(prompts)
        state = model.prefill(ids, 2)
        logits = model.decode_step(ids[:, -1:], state)[:, -1]
    if options is not None:
        penalties = Penalties(len(prompts), logits.shape[-1], "cpu")
        penalties.start(0, [prompt[:len(prompt) - generated] for prompt in prompts],
                        [options] * len(prompts))
        for place in range(generated):
            penalties.record(ids[:, place - generated])
        logits = penalties(logits)
    weights = Sampler(TEMPERATURE, TOP_K).weights(logits)
    return weights / weights.sum(dim=-1, keepdim=True)


def looked_up_prompt(model, vocab_size: int) -> list[int]:
    """A prompt whose last two tokens occurred before, followed by z: prompt lookup
    drafts z first, and z is chosen among the model's likely next tokens, so that its
    draft is kept now and rejected then."""
    prompts = [[1, 275, 268, z, 261, 275, 268] for z in range(4, vocab_size)]
    likelihood = next_distributions(model, prompts)[torch.arange(len(prompts)),
                                                    torch.arange(4, vocab_size)]
    chosen = int((likelihood - 0.5).abs().argmin())
    assert 0.1 < likelihood[chosen] < 0.9
    return prompts[chosen]


@pytest.mark.parametrize("drafts", [{"prompt_lookup": 3}, {"draft_tokens": 3}, {}])
def test_generation_samples_the_model_s_distribution_of_two_tokens(tokenizer, drafts):
    """1,000 prompts, each sampled from its own seed: the frequencies of their first two
    tokens are within 0.06 of the model's p0(x) p1(y | x) (0.020 and 0.027 drafted by
    prompt lookup and the draft model, 0.041 undrafted; a rejection that draws from p
    itself is 0.15-0.17 off)."""
    model = language_model(tokenizer)
    prompt = looked_up_prompt(model, tokenizer.vocab_size)
    first = next_distributions(model, [prompt])[0]
    support = first.nonzero()[:, 0].tolist()
    second = next_distributions(model, [prompt + [x] for x in support])
    exact = torch.zeros(tokenizer.vocab_size, tokenizer.vocab_size)
    exact[support] = first[support, None] * second
    generator = Generator(model, tokenizer,
                          draft=Generator(language_model(tokenizer, noise=0.3), tokenizer))
    trials = 1000
    rows = generator.generate_rows([PromptIds(prompt)] * trials, seeds=range(trials),
                                   max_new_tokens=2, temperature=TEMPERATURE, top_k=TOP_K,
                                   **drafts)
    frequencies = torch.zeros_like(exact)
    for row in rows:
        frequencies[row.tokens[0], row.tokens[1]] += 1 / trials
    assert total_variation(frequencies, exact) < 0.06


@pytest.mark.parametrize("drafts", [{"prompt_lookup": 3}, {"draft_tokens": 3}, {}])
def test_penalized_generation_samples_the_penalized_distribution(tokenizer, drafts):
    """As above with a presence penalty and a logit bias: each drafted place is penalized
    as if the drafted tokens before it had been generated, so the first two tokens
    follow the penalized p0(x) p1(y | x), 0.65 from the unpenalized one, over 1,000 seeds
    (0.024 and 0.033 off drafted by prompt lookup and the draft model, 0.038 undrafted;
    0.21-0.38 where drafted places ignore the drafted tokens before them)."""
    model = language_model(tokenizer)
    prompt = looked_up_prompt(model, tokenizer.vocab_size)
    options = GenerateOptions(presence_penalty=2.0, logit_bias={prompt[3]: 0.5})
    exact = {}
    for name, changes in (("penalized", options), ("plain", None)):
        first = next_distributions(model, [prompt], changes)[0]
        support = first.nonzero()[:, 0].tolist()
        second = next_distributions(model, [prompt + [x] for x in support], changes, 1)
        exact[name] = torch.zeros(tokenizer.vocab_size, tokenizer.vocab_size)
        exact[name][support] = first[support, None] * second
    assert total_variation(exact["penalized"], exact["plain"]) > 0.3
    generator = Generator(model, tokenizer,
                          draft=Generator(language_model(tokenizer, noise=0.3), tokenizer))
    trials = 1000
    rows = generator.generate_rows([PromptIds(prompt)] * trials, seeds=range(trials),
                                   max_new_tokens=2, temperature=TEMPERATURE, top_k=TOP_K,
                                   presence_penalty=2.0, logit_bias={prompt[3]: 0.5},
                                   **drafts)
    frequencies = torch.zeros_like(exact["penalized"])
    for row in rows:
        frequencies[row.tokens[0], row.tokens[1]] += 1 / trials
    assert total_variation(frequencies, exact["penalized"]) < 0.06


def test_a_seed_repeats_its_sample_streamed_or_not(tokenizer):
    generator = Generator(language_model(tokenizer), tokenizer,
                          draft=Generator(language_model(tokenizer, noise=0.3), tokenizer))
    for drafts in ({"prompt_lookup": 4}, {"draft_tokens": 2}):
        settings = {"max_new_tokens": 30, "temperature": 0.8, "top_p": 0.9, **drafts}
        texts = generator.generate(PROMPTS, seed=7, **settings)
        assert generator.generate(PROMPTS, seed=7, **settings) == texts
        assert generator.generate(PROMPTS, seed=8, **settings) != texts
        assert "".join(generator.stream(PROMPTS[0], seed=7, **settings)) == texts[0]
        streamed = [""] * len(PROMPTS)
        for pieces in generator.stream_batch(PROMPTS, seed=7, **settings):
            streamed = [text + piece for text, piece in zip(streamed, pieces)]
        assert streamed == texts


@pytest.mark.parametrize("draft_by", ["prompt lookup", "noisy draft model", "the model"])
def test_sampled_steps_keep_drafts_as_often_as_the_distributions_agree(tokenizer, draft_by):
    """Drafts are kept and rejected along the way, and fewer steps than tokens taken; the
    model drafting for itself (q = p) has every draft kept."""
    model = language_model(tokenizer)
    generator = Generator(model, tokenizer)
    draft = model if draft_by == "the model" else language_model(tokenizer, noise=0.3)
    options = GenerateOptions(max_new_tokens=40, temperature=0.7)
    drafted = kept = steps = tokens = 0
    for index, ids in enumerate(generator.encode(PROMPTS)):
        row = generator.continuation(ids, options)
        sampler = Sampler(0.7, seed=index)
        drafter = NgramIndex(ids) if draft_by == "prompt lookup" else \
            DraftModel(draft, ids, row.limit + 5, sampler=sampler)
        with torch.inference_mode():
            for step_drafted, step_kept in speculative_steps(model, torch.tensor([ids]), row,
                                                             drafter, 4, sampler=sampler):
                drafted, kept, steps = drafted + step_drafted, kept + step_kept, steps + 1
        tokens += len(row.tokens) + row.ended
    assert 0 < kept < drafted if draft_by != "the model" else kept == drafted > 0
    assert steps < tokens


def test_the_cli_samples_with_drafts_and_repeats_a_seed(tokenizer, tiny_corpus, tmp_path,
                                                         capsys):
    from transduce import checkpoint

    checkpoint.save(tmp_path / "lm", language_model(tokenizer), None, tiny_corpus / "spm.model")
    checkpoint.save(tmp_path / "draft", language_model(tokenizer, noise=0.3), None,
                    tiny_corpus / "spm.model")
    outputs = []
    for extra in (["--prompt-lookup", "3"], ["--prompt-lookup", "3"],
                  ["--draft-model", str(tmp_path / "draft")]):
        assert main(["generate", "--model", str(tmp_path / "lm"), "--prompt", PROMPTS[0],
                     "--prompt", PROMPTS[1], "--max-new-tokens", "20", "--temperature", "0.9",
                     "--seed", "3", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == 2
    assert outputs[2].count("\n") == 2

