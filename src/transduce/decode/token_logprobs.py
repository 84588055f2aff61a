"""Each token's log-probability given the tokens before it, and the likeliest tokens in
its place: what OpenAI's completions answer with `logprobs` (an evaluation harness sums
a continuation's to compare answers, and checks whether each was the likeliest).

One causal pass over each whole sequence, as `evaluate` scores lines; no cache takes
part, so a prompt and what was generated from it are scored as one text (the cached
steps' log-probabilities to float tolerance, tested). Sequences are right-padded into
batches: a padded place follows every real one, which a causal model never reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor

from transduce.decode.onnx_lm_engine import OnnxLanguageModel
from transduce.decode.options import pass_batch_tokens
from transduce.model import DecoderOnly

# Logits per chunk: (rows, V) float32 of 8 MiB, and an ONNX batch's whole (B, T, V) at
# most 256 MiB (the graph returns every place's logits at once).
CHUNK_ELEMENTS = 1 << 21
ONNX_LOGITS_ELEMENTS = 1 << 26


@dataclass
class TokenLogprobs:
    """Of a sequence of n tokens: the log-probability of each of tokens[1:] (the first
    has nothing before it), and in each of those places the `top` likeliest tokens,
    (id, log-probability), best first."""

    logprobs: list[float]                       # (n - 1,)
    top: list[list[tuple[int, float]]]          # (n - 1, top)


def token_logprobs(model: DecoderOnly | OnnxLanguageModel, sequences: Sequence[Sequence[int]],
                   top: int = 0, *, device: torch.device | str = "cpu",
                   batch_tokens: int | None = None) -> list[TokenLogprobs]:
    """The log-probabilities of every token of each sequence (each one at most as long
    as the model reads) under the model, and the `top` likeliest in each place, in the
    sequences' order; natural logarithms, from float32 logits. batch_tokens: places per
    batch (None: options.pass_batch_tokens, 512 on a CPU)."""
    vocab = model.config.tgt_vocab_size
    if isinstance(model, OnnxLanguageModel):
        batch_tokens = max(1, ONNX_LOGITS_ELEMENTS // vocab)
    elif batch_tokens is None:
        batch_tokens = pass_batch_tokens(device)
    found: dict[int, TokenLogprobs] = {}
    with torch.inference_mode():
        for indices in _batches([len(s) for s in sequences], batch_tokens):
            rows = [list(sequences[i]) for i in indices]
            found.update(zip(indices, _score_batch(model, rows, top, device)))
    return [found[i] for i in range(len(sequences))]


def _batches(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of sequences of like lengths, longest first, a batch's padded places
    within batch_tokens (a longer sequence alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for index in order:
        if batch and (len(batch) + 1) * lengths[batch[0]] > batch_tokens:
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


def _score_batch(model: DecoderOnly | OnnxLanguageModel, rows: list[list[int]], top: int,
                 device: torch.device | str) -> list[TokenLogprobs]:
    """One right-padded batch: its rows' places but the last (B, T - 1) read to score
    the tokens that follow them."""
    width = max(len(row) for row in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)                  # (B, T)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    tokens = tokens.to(device)
    lengths = torch.tensor([len(row) for row in rows], device=device)
    keep = torch.arange(width - 1, device=device) < lengths[:, None] - 1     # (B, T - 1)
    targets = tokens[:, 1:][keep]                                            # (N,)
    chosen, best_ids, best = _scored_places(model, tokens[:, :-1], keep, targets, top)
    out, start = [], 0
    for row in rows:
        end = start + len(row) - 1
        out.append(TokenLogprobs(
            chosen[start:end].tolist(),
            [list(zip(ids, values)) for ids, values in
             zip(best_ids[start:end].tolist(), best[start:end].tolist())]))
        start = end
    return out


def _scored_places(model: DecoderOnly | OnnxLanguageModel, tokens: Tensor, keep: Tensor,
                   targets: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """tokens (B, T) read, keep (B, T) the places scored, targets (N,) the tokens that
    follow them -> each target's log-probability (N,), and the top ids (N, top) and
    their log-probabilities (N, top); a chunk of places' logits at a time."""
    if isinstance(model, OnnxLanguageModel):
        logits = model.logits(tokens)[keep]                                   # (N, V)
        rows, project = logits, (lambda part: part)
    else:
        rows = model(tokens, project=False)[keep]                             # (N, C)
        project = model.logits
    if rows.shape[0] == 0:                               # one-token sequences only
        return torch.zeros(0), torch.zeros(0, top, dtype=torch.long), torch.zeros(0, top)
    chunk = max(1, CHUNK_ELEMENTS // model.config.tgt_vocab_size)
    chosen, best_ids, best = [], [], []
    for first in range(0, rows.shape[0], chunk):
        logprobs = torch.log_softmax(project(rows[first:first + chunk]).float(), dim=-1)
        chosen.append(logprobs.gather(1, targets[first:first + chunk, None])[:, 0])
        values, ids = logprobs.topk(top, dim=-1)
        best.append(values)
        best_ids.append(ids)
    return torch.cat(chosen), torch.cat(best_ids), torch.cat(best)
