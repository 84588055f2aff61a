"""Prompt lookup decoding: greedy search that guesses its next tokens by copying them
from what it has read, and checks the guesses in one pass.

A decoding step of one prompt costs about as much for a few tokens as for one: every
weight streams from memory once either way. Where a continuation repeats text it has
seen (quoting or editing its prompt, a summary, code, a formulaic document, a loop),
the tokens that followed the latest earlier occurrence of its last n tokens are a good
guess of the next ones (NgramIndex). A step then feeds the pending token and up to K
drafted ones. The model's greedy choice after each of them is what greedy search would
choose there, so the draft is kept up to its first token that differs, and the model's
choice at that place is taken too: every step gains between 1 and K + 1 tokens, the
caches forget the rest (rewind), and the output is greedy search's. (Up to rounding:
positions computed together may sum in another order than one at a time, which can
turn a near tie, as batching prompts can; equal token for token on random models in
float32 and int8 (tests) and on trained ones (bench/lookup.py).)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transduce.decode.generate import Continuation

# The longest n-gram looked up first; shorter ones down to a single token after it.
LOOKUP_NGRAM = 3


class NgramIndex:
    """A token sequence that grows, and for each of its n-grams (n = 1..max_n) where the
    token after its latest occurrence stands, so that a draft is one dict look-up."""

    def __init__(self, tokens: list[int], max_n: int = LOOKUP_NGRAM):
        self.tokens: list[int] = []
        self.max_n = max_n
        self.follower: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens: each becomes the follower of the n-grams that end before it."""
        for token in tokens:
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self.follower[n][tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def draft(self, count: int) -> list[int]:
        """At most `count` tokens: those after the latest earlier occurrence of the
        sequence's last n tokens, for the longest n that occurred before ([]: none)."""
        if count <= 0:
            return []
        for n in range(min(self.max_n, len(self.tokens)), 0, -1):
            start = self.follower[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + count]
        return []


def accepted(draft: list[int], chosen: list[int]) -> int:
    """How many drafted tokens greedy search confirms: draft[i] is kept while it is the
    model's choice after the tokens before it (chosen[i]), up to the first that is not."""
    kept = 0
    while kept < len(draft) and draft[kept] == chosen[kept]:
        kept += 1
    return kept


def lookup_steps(model, prompt: Tensor, row: "Continuation", drafts: int,
                 cache_dtype: torch.dtype | None = None) -> Iterator[tuple[int, int]]:
    """Greedy search of one prompt (1, P) with up to `drafts` tokens drafted by prompt
    lookup a step; `row` takes the tokens (and ends at eos, a stop or its limit). model:
    a DecoderOnly or an ONNX export (prefill, decode_step, a state that rewinds). Yields
    after each step how many tokens it drafted and how many of them it kept."""
    state = model.prefill(prompt, row.limit + drafts + 1, cache_dtype=cache_dtype)
    index = NgramIndex(prompt[0].tolist())
    token = index.tokens[-1]
    while not row.finished:
        draft = index.draft(min(drafts, row.limit - len(row.tokens) - 1))
        start = state.length
        fed = torch.tensor([[token, *draft]], device=prompt.device)         # (1, 1 + d)
        chosen = model.decode_step(fed, state)[0].float().argmax(dim=-1).tolist()
        kept = accepted(draft, chosen)
        state.rewind(start + 1 + kept)
        new = chosen[:kept + 1]
        for value in new:
            row.add(value)
            if row.finished:
                break
        index.extend(new)
        token = new[-1]
        yield len(draft), kept
