"""Speculative decoding: guess the next tokens cheaply, check the guesses in one pass.

A decoding step of one prompt costs about as much for a few tokens as for one: every
weight streams from memory once either way. A drafter guesses up to K next tokens:
prompt lookup copies what followed the latest earlier occurrence of the last few tokens
(lookup.py: NgramIndex), a draft model, a smaller language model of the same
vocabulary, continues by its own choices (draft_model.py: DraftModel). A step then
feeds the pending token and the draft, and the model's outputs after each of them say
which drafted tokens to keep: every step gains between 1 and K + 1 tokens, and the
caches forget the rest (rewind).

Greedy search keeps the draft up to its first token that is not the model's greedy
choice there, and takes the model's choice at that place too: the output is greedy
search's. (Up to rounding: positions computed together may sum in another order than
one at a time, which can turn a near tie, as batching prompts can; equal token for
token on random models in float32 and int8 (tests) and on trained ones
(bench/lookup.py).) Penalties and a logit bias (penalties.py) change the logits at each
place as if the drafted tokens before it had been generated, so the choices checked are
those the search makes without drafts.

Sampling keeps drafted token x, drawn from the drafter's distribution q, with
probability min(1, p(x) / q(x)), p the model's sampling distribution there (after
temperature, top_k, top_p); at the first it rejects, it draws from max(0, p - q)
renormalized instead, and after a draft kept whole, from p. Each token so emitted is
distributed exactly as p given the tokens before it (Leviathan et al. 2023; Chen et al.
2023), so the output is a sample of the same distribution as plain sampling's, not the
same sample: the seed drives other draws. A prompt lookup's draft is chosen for
certain (q is one at x): x is kept with probability p(x), and a rejection draws from p
without x.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transduce.decode.generate import Continuation
    from transduce.decode.penalties import Penalties
    from transduce.decode.sampling import Sampler


class Drafter(Protocol):
    """What guesses a prompt's next tokens: it reads the sequence as it grows."""

    # (d, V): the distribution each token of the latest draft was drawn from; None where
    # the draft was chosen for certain (prompt lookup, a greedy draft model).
    distributions: Tensor | None

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


def greedy_verified(draft: list[int], logits: Tensor) -> list[int]:
    """The drafted tokens greedy search confirms and its choice after them. logits
    (d + 1, V): the model's after the token before each drafted one and after the last."""
    chosen = logits.argmax(dim=-1).tolist()
    return chosen[:accepted(draft, chosen) + 1]


def sampled_verified(draft: list[int], distributions: Tensor | None, logits: Tensor,
                     sampler: "Sampler", row: int) -> list[int]:
    """The drafted tokens that sampling keeps and one more token drawn after them (see
    the module's docstring). distributions (d, V): what the draft was drawn from (None:
    chosen for certain); logits (d + 1, V): the model's after the token before each
    drafted one and after the last, turned into its sampling distribution (temperature,
    top_k, top_p) only as far as the drafts are kept; randomness from `sampler`'s
    generator of row `row`."""
    uniforms = sampler.uniforms(len(draft), row).tolist() if draft else []
    for place, token in enumerate(draft):
        target = sampler.distribution(logits[place:place + 1])[0]         # (V,)
        drafted = None if distributions is None else distributions[place].to(target.device)
        q = 1.0 if drafted is None else float(drafted[token])
        if uniforms[place] * q < float(target[token]):     # kept: probability min(1, p / q)
            continue
        if drafted is None:                 # chosen for certain: q is 1 at the token
            drafted = torch.zeros_like(target)
            drafted[token] = 1.0
        residual = (target - drafted).clamp_(min=0)
        if not residual.any():          # p == q but for rounding, which made the rejection
            residual = target
        return draft[:place] + [int(sampler.draw(residual[None], [row])[0])]
    return draft + [int(sampler.draw(sampler.weights(logits[-1:]), [row])[0])]


class DraftLength:
    """How many tokens the next step drafts: `most` each step (constant), or (adaptive)
    starting at `most`, one fewer after a step that rejected a drafted token (down to
    one) and two more after a step that kept a whole draft (up to `most`): a drafter
    that is often wrong then wastes few positions a step, and one that is right drafts
    far."""

    def __init__(self, most: int, adaptive: bool):
        self.most, self.adaptive, self.count = most, adaptive, most

    def update(self, drafted: int, kept: int) -> None:
        """A step drafted `drafted` tokens and kept `kept` of them."""
        if self.adaptive and drafted:
            self.count = min(self.most, self.count + 2) if kept == drafted else \
                max(1, self.count - 1)


def speculative_steps(model, prompt: Tensor, row: "Continuation", drafter: Drafter,
                      drafts: int, cache_dtype: torch.dtype | None = None,
                      sampler: "Sampler | None" = None, sampler_row: int = 0,
                      penalties: "Penalties | None" = None, adaptive: bool = False
                      ) -> Iterator[tuple[int, int]]:
    """Greedy search (sampler None) or sampling (by `sampler`'s row `sampler_row`) of one
    prompt (1, P) with up to `drafts` tokens a step guessed by `drafter` (which has read
    the prompt; adaptive: fewer after rejections, DraftLength); `row` takes the tokens
    (and ends at eos, a stop or its limit). model: a DecoderOnly or an ONNX export
    (prefill, decode_step, a state that rewinds). penalties: what changes the logits
    (row 0 started with the prompt; None: nothing), at each place as if the drafted
    tokens before it had been generated. Yields after each step how many tokens it
    drafted and how many of them it kept."""
    state = model.prefill(prompt, row.limit + drafts + 1, cache_dtype=cache_dtype)
    state.allow_rewind(drafts)         # a step forgets at most its whole draft
    token = int(prompt[0, -1])
    length = DraftLength(drafts, adaptive)
    while not row.finished:
        draft = drafter.draft(min(length.count, row.limit - len(row.tokens) - 1))
        start = state.length
        fed = torch.tensor([[token, *draft]], device=prompt.device)         # (1, 1 + d)
        logits = model.decode_step(fed, state)[0].float()                   # (1 + d, V)
        if penalties is not None:
            logits = penalties.drafted(logits, draft)
        new = greedy_verified(draft, logits) if sampler is None else \
            sampled_verified(draft, drafter.distributions, logits, sampler, sampler_row)
        if penalties is not None:
            penalties.extend(new)
        state.rewind(start + len(new))
        for value in new:
            row.add(value)
            if row.finished:
                break
        drafter.extend(new)
        token = new[-1]
        length.update(len(draft), len(new) - 1)
        yield len(draft), len(new) - 1
