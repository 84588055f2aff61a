"""A draft model: a speculative search's drafts (speculative.py) written by a smaller
language model of the same vocabulary, by greedy search or sampling over caches of its
own. The smaller the draft against the model, and the more often it agrees with it, the
more a step saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transduce.decode.penalties import Penalties
    from transduce.decode.sampling import Sampler


class DraftModel:
    """Drafts of `model` (a DecoderOnly or an ONNX export) for one sequence: its greedy
    choices, or with a sampler, its samples (their distributions kept for the
    verification: speculative.sampled_verified). Its caches hold the sequence as far as
    they agree with it: a rejected guess is forgotten (rewind) before the next draft, and
    the tokens not yet read are fed in one pass. Where the sequence outgrows the draft
    model's positions, it drafts nothing more."""

    def __init__(self, model, tokens: list[int], room: int,
                 cache_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", sampler: "Sampler | None" = None,
                 sampler_row: int = 0, penalties: "Penalties | None" = None):
        """tokens: the prompt; room: tokens the sequence may grow by, drafts included;
        sampler: draws the drafts (None: greedy) from its generator of row
        `sampler_row`; penalties: the search's (row 0 holding the tokens it has kept),
        applied to the draft's logits too, so that it guesses what the search will
        choose."""
        self.model, self.device = model, device
        self.sampler, self.sampler_row = sampler, sampler_row
        self.penalties = penalties
        self.distributions: Tensor | None = None
        self.tokens = list(tokens)
        self.context = model.config.max_positions
        self.cached = self.tokens[:-1]        # what the caches hold: all but the last
        self.agreed = len(self.cached)        # cached[:agreed] == tokens[:agreed]
        self.state = None
        if len(self.tokens) < self.context:
            prompt = torch.tensor([self.tokens], device=device)
            self.state = model.prefill(prompt, min(room, self.context - len(self.tokens)),
                                       cache_dtype=cache_dtype)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def draft(self, count: int) -> list[int]:
        """The draft model's continuation of the sequence, `count` tokens (fewer near the
        end of its positions)."""
        count = min(count, self.context - len(self.tokens))
        if count <= 0 or self.state is None:
            return []
        same = self.agreed
        limit = min(len(self.cached), len(self.tokens) - 1)    # one token at least to feed
        while same < limit and self.cached[same] == self.tokens[same]:
            same += 1
        self.state.rewind(same)
        self.state.allow_rewind(count)      # the next draft forgets at most this one
        del self.cached[same:]
        fed, drafted, distributions = self.tokens[same:], [], []
        for _ in range(count):
            logits = self.model.decode_step(torch.tensor([fed], device=self.device),
                                            self.state)[0, -1:].float()      # (1, V)
            if self.penalties is not None:
                logits = self.penalties.drafted(logits.to(self.penalties.counts.device),
                                                drafted).to(logits.device)
            self.cached.extend(fed)
            if self.sampler is None:
                fed = [int(logits.argmax())]
            else:
                distribution = self.sampler.distribution(logits)             # (1, V)
                distributions.append(distribution[0])
                fed = [int(self.sampler.draw(distribution, [self.sampler_row])[0])]
            drafted += fed
        self.agreed = len(self.tokens)
        self.distributions = torch.stack(distributions) if distributions else None
        return drafted
