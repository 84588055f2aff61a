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
        repetition, frequency, presence = self.penalties[:count].unbind(dim=-1)
        counts = self.counts[:count]
        logits = penalize_repetition(logits.float(), self.seen[:count], repetition[:, None])
        return (logits - counts * frequency[:, None]
                - (counts > 0).float() * presence[:, None] + self.bias[:count])

    def record(self, tokens: Tensor) -> None:
        """The first R' rows generated tokens (R',): seen, and counted."""
        rows = torch.arange(len(tokens), device=tokens.device)
        self.seen[rows, tokens] = True
        self.counts[rows, tokens] += 1

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
