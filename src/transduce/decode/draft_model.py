"""A draft model: a speculative search's drafts (speculative.py) written by a smaller
language model of the same vocabulary, by greedy search over caches of its own. The
smaller the draft against the model, and the more often it agrees with it, the more a
step saves.
"""

from __future__ import annotations

import torch


class DraftModel:
    """Greedy drafts of `model` (a DecoderOnly or an ONNX export) for one sequence. Its
    caches hold the sequence as far as they agree with it: a rejected guess is forgotten
    (rewind) before the next draft, and the tokens not yet read are fed in one pass.
    Where the sequence outgrows the draft model's positions, it drafts nothing more."""

    def __init__(self, model, tokens: list[int], room: int,
                 cache_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu"):
        """tokens: the prompt; room: tokens the sequence may grow by, drafts included."""
        self.model, self.device = model, device
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
        """The draft model's greedy continuation of the sequence, `count` tokens (fewer
        near the end of its positions)."""
        count = min(count, self.context - len(self.tokens))
        if count <= 0 or self.state is None:
            return []
        same = self.agreed
        limit = min(len(self.cached), len(self.tokens) - 1)    # one token at least to feed
        while same < limit and self.cached[same] == self.tokens[same]:
            same += 1
        self.state.rewind(same)
        del self.cached[same:]
        fed, drafted = self.tokens[same:], []
        for _ in range(count):
            logits = self.model.decode_step(torch.tensor([fed], device=self.device),
                                            self.state)[0, -1]
            self.cached.extend(fed)
            fed = [int(logits.float().argmax())]
            drafted += fed
        self.agreed = len(self.tokens)
        return drafted
