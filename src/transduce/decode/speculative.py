"""Speculative greedy search: guess the next tokens cheaply, check the guesses in one pass.

A decoding step of one prompt costs about as much for a few tokens as for one: every
weight streams from memory once either way. A drafter guesses up to K next tokens:
prompt lookup copies what followed the latest earlier occurrence of the last few tokens
(lookup.py: NgramIndex), a draft model, a smaller language model of the same
vocabulary, continues greedily (draft_model.py: DraftModel). A step then feeds the
pending token and the draft. The model's greedy choice after each of them is what
greedy search would choose there, so the draft is kept up to its first token that
differs, and the model's choice at that place is taken too: every step gains between 1
and K + 1 tokens, the caches forget the rest (rewind), and the output is greedy
search's. (Up to rounding: positions computed together may sum in another order than
one at a time, which can turn a near tie, as batching prompts can; equal token for
token on random models in float32 and int8 (tests) and on trained ones
(bench/lookup.py).)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transduce.decode.generate import Continuation


class Drafter(Protocol):
    """What guesses a prompt's next tokens: it reads the sequence as it grows."""

    def extend(self, tokens: list[int]) -> None:
        """Append tokens that the model has confirmed."""

    def draft(self, count: int) -> list[int]:
        """At most `count` guesses of the tokens that follow the sequence."""


def accepted(draft: list[int], chosen: list[int]) -> int:
    """How many drafted tokens greedy search confirms: draft[i] is kept while it is the
    model's choice after the tokens before it (chosen[i]), up to the first that is not."""
    kept = 0
    while kept < len(draft) and draft[kept] == chosen[kept]:
        kept += 1
    return kept


def speculative_steps(model, prompt: Tensor, row: "Continuation", drafter: Drafter,
                      drafts: int, cache_dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[int, int]]:
    """Greedy search of one prompt (1, P) with up to `drafts` tokens a step guessed by
    `drafter` (which has read the prompt); `row` takes the tokens (and ends at eos, a
    stop or its limit). model: a DecoderOnly or an ONNX export (prefill, decode_step,
    a state that rewinds). Yields after each step how many tokens it drafted and how
    many of them it kept."""
    state = model.prefill(prompt, row.limit + drafts + 1, cache_dtype=cache_dtype)
    token = int(prompt[0, -1])
    while not row.finished:
        draft = drafter.draft(min(drafts, row.limit - len(row.tokens) - 1))
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
        drafter.extend(new)
        token = new[-1]
        yield len(draft), kept
