"""What a row's logits are changed by before its token is chosen, from the tokens it has
read and written: the repetition penalty (CTRL), OpenAI's frequency and presence
penalties, and a logit bias per token. Greedy search and sampling see the changed
logits alike (a sampler's temperature divides them after).

    logits[v] = repetition(logits[v]) - frequency * count[v] - presence * (count[v] > 0)
                + bias[v]

count[v]: how often the row has generated v (its prompt not counted, as OpenAI counts);
repetition: sampling.penalize_repetition over the prompt's tokens and the output's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from transduce.decode.sampling import penalize_repetition

if TYPE_CHECKING:
    from transduce.decode.options import GenerateOptions


# A row's repetition, frequency and presence penalties when it has none.
OFF = torch.tensor([1.0, 0.0, 0.0])


class Penalties:
    """Per-row buffers of a batch whose rows may each have their own options: the tokens
    a row has read or written (seen), how often it wrote each (counts), its bias, and
    its three penalties. Rows are started when they join, and kept or moved with the
    batch's rows."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str):
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)    # (R, V)
        self.counts = torch.zeros(rows, vocab, device=device)                     # (R, V)
        self.bias = torch.zeros(rows, vocab, device=device)                       # (R, V)
        self.penalties = OFF.to(device).repeat(rows, 1)       # (R, 3): each row's, off

    def start(self, first: int, prompts: Sequence[Sequence[int]],
              settings: Sequence["GenerateOptions"]) -> None:
        """Rows first .. first + len(prompts) - 1 begin: prompt ids, and each's options."""
        rows = slice(first, first + len(prompts))
        self.seen[rows] = False
        self.counts[rows] = 0
        self.bias[rows] = 0
        self.penalties[rows] = torch.tensor(
            [[each.repetition_penalty, each.frequency_penalty, each.presence_penalty]
             for each in settings], device=self.penalties.device)
        for row, (ids, each) in enumerate(zip(prompts, settings), start=first):
            self.seen[row, list(ids)] = True
            if each.logit_bias:
                tokens, biases = zip(*each.logit_bias)              # sorted (id, bias) pairs
                self.bias[row, list(tokens)] = torch.tensor(biases, device=self.bias.device)

    def __call__(self, logits: Tensor) -> Tensor:
        """logits (R', V) of the first R' rows -> the changed logits (R', V) float32."""
        count = logits.shape[0]
        return _changed(logits, self.seen[:count], self.counts[:count],
                        self.penalties[:count], self.bias[:count])

    def drafted(self, logits: Tensor, draft: Sequence[int]) -> Tensor:
        """Row 0's logits at the last places of a drafted sequence, each changed as if
        the drafted tokens before it had been generated (a speculative search's step:
        decode/speculative.py). logits (P, V): the last place after all of `draft`, so
        place i after draft[:len(draft) - P + 1 + i] -> (P, V) float32."""
        places, vocab = logits.shape
        drafted = torch.zeros(len(draft) + 1, vocab, device=self.counts.device)  # (D + 1, V)
        if draft:
            tokens = torch.tensor(list(draft), device=drafted.device)
            drafted[torch.arange(1, len(draft) + 1, device=drafted.device), tokens] = 1.0
        before = drafted.cumsum(dim=0)[-places:]          # (P, V): drafted before each place
        return _changed(logits, self.seen[:1] | (before > 0), self.counts[:1] + before,
                        self.penalties[:1].expand(places, -1), self.bias[:1])

    def record(self, tokens: Tensor) -> None:
        """The first R' rows generated tokens (R',): seen, and counted."""
        rows = torch.arange(len(tokens), device=tokens.device)
        self.seen[rows, tokens] = True
        self.counts[rows, tokens] += 1

    def extend(self, tokens: Sequence[int]) -> None:
        """Row 0 generated `tokens`, in order (a speculative step's)."""
        ids = torch.tensor(list(tokens), device=self.counts.device)
        self.seen[0, ids] = True
        self.counts[0].index_add_(0, ids, torch.ones(len(ids), device=ids.device))

    def select(self, index: Tensor) -> None:
        """Keep rows `index` (R',), in that order: a static batch's running rows."""
        for name in ("seen", "counts", "bias", "penalties"):
            setattr(self, name, getattr(self, name)[index])

    def move(self, destinations: Tensor, sources: Tensor) -> None:
        """Row sources[i]'s buffers to row destinations[i] (rows leaving a running batch)."""
        for buffer in (self.seen, self.counts, self.bias, self.penalties):
            buffer[destinations] = buffer[sources]

    def grow(self, rows: int) -> None:
        """Room for `rows` rows, the new ones empty, their penalties off."""
        for name in ("seen", "counts", "bias", "penalties"):
            old = getattr(self, name)
            if old.shape[0] < rows:
                new = old.new_zeros(rows, *old.shape[1:])
                new[:old.shape[0]] = old
                if name == "penalties":
                    new[old.shape[0]:] = OFF.to(new.device)
                setattr(self, name, new)


def _changed(logits: Tensor, seen: Tensor, counts: Tensor, penalties: Tensor,
             bias: Tensor) -> Tensor:
    """The module's formula: logits (R, V), seen (R, V) boolean, counts (R, V), penalties
    (R, 3) (repetition, frequency, presence), bias (R, V) or (1, V) -> (R, V) float32."""
    repetition, frequency, presence = penalties.unbind(dim=-1)
    logits = penalize_repetition(logits.float(), seen, repetition[:, None])
    return (logits - counts * frequency[:, None] - (counts > 0).float() * presence[:, None]
            + bias)
