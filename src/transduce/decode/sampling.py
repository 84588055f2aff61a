"""Choosing the next token from the logits: temperature, top-k, nucleus (top-p) and the
repetition penalty, and each row's seed. Shared by translation sampling and
language-model generation.

Shapes: logits (B, V) for the rows decoding now -> tokens (B,).
"""

from __future__ import annotations

import math
import secrets
from typing import Mapping, Sequence

import torch
from torch import Tensor

from transduce.config import ConfigError


class Sampler:
    """Draw each token from softmax(logits / temperature), restricted to the top_k most
    likely tokens (0: all), to the smallest set whose probability reaches top_p
    (nucleus sampling, Holtzman et al. 2020) and to the tokens at least min_p times as
    likely as the likeliest (min-p sampling, Nguyen et al. 2024; 0: all). A seeded
    sampler repeats exactly.

    Called with row ids, each row draws from its own generator, seeded with
    row_seeds[row] (or `seed`), so that a prompt samples the same continuation whatever
    else shares its batch."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, device: torch.device | str = "cpu", *,
                 row_seeds: Sequence[int] | Mapping[int, int] | None = None,
                 min_p: float = 0.0):
        check_sampling(temperature, top_k, top_p, min_p)
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.seed = seed if seed is not None else secrets.randbits(62)
        self.device, self.row_seeds = device, row_seeds
        self.generator = self._new_generator(self.seed)
        self.row_generators: dict[int, torch.Generator] = {}

    def _new_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def _row_generator(self, row: int) -> torch.Generator:
        if row not in self.row_generators:
            seed = self.seed if self.row_seeds is None else self.row_seeds[row]
            self.row_generators[row] = self._new_generator(seed)
        return self.row_generators[row]

    def forget(self, rows: Sequence[int]) -> None:
        """Drop the generators of rows that are done (a running batch's ids keep coming)."""
        for row in rows:
            self.row_generators.pop(row, None)

    def __call__(self, logits: Tensor, rows: list[int] | None = None) -> Tensor:
        """logits (B, V) -> tokens (B,); rows: the id of each row's own generator."""
        return self.draw(self.weights(logits), rows)

    def weights(self, logits: Tensor) -> Tensor:
        """logits (B, V) -> (B, V) float32: each row's probabilities after the
        temperature, top_k, top_p and min_p, times a constant of the row (its best is 1)."""
        logits = logits.float()
        # Shifted so that the best logit is 0 before dividing, and the temperature kept
        # from rounding to 0 in float32: the probabilities are unchanged, and a tiny one sends
        # the others to -inf (greedy) instead of giving inf - inf or 0 / 0 = nan.
        temperature = max(self.temperature, torch.finfo(torch.float32).tiny)
        logits = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature)  # (B, V)
        return filter_logits(logits, self.top_k, self.top_p, self.min_p).exp_()

    def distribution(self, logits: Tensor) -> Tensor:
        """logits (B, V) -> (B, V): the distribution each row's token is drawn from."""
        weights = self.weights(logits)
        return weights / weights.sum(dim=-1, keepdim=True)

    def uniforms(self, count: int, row: int) -> Tensor:
        """`count` draws uniform in [0, 1) from row `row`'s generator -> (count,)."""
        return torch.rand(count, generator=self._row_generator(row), device=self.device)

    def draw(self, weights: Tensor, rows: list[int] | None = None) -> Tensor:
        """weights (B, V) >= 0, each row with one above 0 -> tokens (B,), each drawn with
        probability proportional to its weight; rows: the id of each row's generator."""
        uniforms = torch.empty(weights.shape, device=self.device)
        if rows is None:
            torch.rand(weights.shape, generator=self.generator, out=uniforms)
        else:
            for i, row in enumerate(rows):
                torch.rand(weights.shape[-1:], generator=self._row_generator(row), out=uniforms[i])
        return exponential_race(weights, uniforms.to(weights.device))


def exponential_race(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Each row's token drawn with probability proportional to its weight, as the winner
    of a race: token v arrives at E_v / w_v with E_v ~ Exp(1) independent, and the first
    to arrive is v with probability w_v / sum(w) (what torch.multinomial does for one
    draw; here the uniforms come from the rows' own generators, 16.6 us a row for 8,000
    tokens where multinomial took 129 on a 2-core Zen 4, and the rest runs batched, in
    place). Two tokens
    tie only when their ratios do, so rounding that differs by batch rarely changes a
    draw (inverting the cumulative sum flips one whenever rounding crosses a boundary).
    A token of weight 0 never wins. weights (B, V) >= 0, each row with one above 0;
    uniforms (B, V) in [0, 1), overwritten -> tokens (B,)."""
    # log(1 - u) = -E_v, kept below 0 (u = 0 is an arrival at 0), so w_v / log(1 - u) is
    # -w_v / E_v: the first to arrive has the smallest, and a weight of 0 gives 0.
    minus_arrivals = uniforms.neg_().log1p_().clamp_(max=-torch.finfo(uniforms.dtype).tiny)
    return (weights / minus_arrivals).argmin(dim=-1)


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> None:
    """A ConfigError naming the option that is out of range."""
    if not temperature > 0 or temperature == float("inf"):
        raise ConfigError(f"temperature={temperature}: must be a positive number "
                          f"(use greedy search for temperature 0)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"top_k={top_k!r}: must be an integer >= 0 (0: no limit)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p}: must be in (0, 1]")
    if not 0 <= min_p <= 1:
        raise ConfigError(f"min_p={min_p}: must be in [0, 1] (0: off)")


def filter_logits(logits: Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """logits (B, V) with every token outside the top_k, outside the nucleus of
    probability top_p, and less than min_p times as likely as the likeliest set to -inf
    (the most likely token always stays), in that order, as transformers' warpers."""
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(~nucleus(logits.softmax(dim=-1), top_p), float("-inf"))
    if min_p > 0:          # p / p_max = exp(logit - its max): a comparison of logits
        floor = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


# The likeliest tokens a row's nucleus is looked for among first, then more: most nuclei
# of a trained model hold a few dozen tokens, and on a Zen 5 the top 64 of 8,000 came in
# 12 us where sorting them all took 358 (top 1,024: 18 us; of 128,000: 126 us, 439 us
# and 8.2 ms).
NUCLEUS_CANDIDATES = (64, 1024)


def nucleus(probs: Tensor, top_p: float,
            candidates: tuple[int, ...] = NUCLEUS_CANDIDATES) -> Tensor:
    """probs (B, V) -> (B, V) boolean: each row's nucleus, its likeliest tokens down to
    the first whose more likely ones reach top_p together, the likeliest always (a top_p
    that rounds to 0 in float32 would leave nothing). Looked for among a row's top
    candidates[0], and where they do not hold it, among more (all, sorted, at last)."""
    vocab = probs.shape[-1]
    count = next((c for c in candidates if c < vocab), vocab)
    likeliest, order = probs.topk(count, dim=-1)                          # (B, count)
    before = likeliest.cumsum(dim=-1) - likeliest       # what the more likely ones hold
    in_sorted = before < top_p
    in_sorted[:, 0] = True
    inside = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, in_sorted)
    beyond = (before[:, -1] < top_p).nonzero()[:, 0]      # rows whose nucleus goes on
    if count < vocab and len(beyond):
        inside[beyond] = nucleus(probs[beyond], top_p, tuple(c for c in candidates if c > count))
    return inside


def penalize_repetition(logits: Tensor, seen: Tensor, penalty: float | Tensor) -> Tensor:
    """The CTRL repetition penalty (Keskar et al. 2019): the logit of every token already
    in the row (prompt or output) is divided by penalty when positive and multiplied by
    it when negative. logits (B, V), seen (B, V) boolean, penalty a number or (B, 1) one
    per row -> (B, V). A penalty far from 1 saturates at the dtype's largest finite
    logits instead of giving inf (whose difference, inf - inf, would make the softmax
    nan)."""
    if not isinstance(penalty, Tensor) and penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    largest = torch.finfo(logits.dtype).max
    return torch.where(seen, penalized.clamp(-largest, largest), logits)


def prompt_seeds(seed: int | None, count: int, start: int = 0) -> list[int]:
    """The sampling seeds of prompts start .. start + count - 1 given `seed` (None: a
    fresh one): prompt 0's is `seed` itself, the others' are mixed from (seed, index), so
    that a prompt given twice draws two samples, and each draws what it draws whatever
    else shares its batch."""
    base = secrets.randbits(62) if seed is None else seed
    return [base if index == 0 else _mixed(base, index)
            for index in range(start, start + count)]


def _mixed(seed: int, index: int) -> int:
    """SplitMix64 (Steele et al. 2014) of seed + index * the golden ratio, to 63 bits."""
    mask = 2**64 - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1
