"""Search over the model's output distribution, one token per step through the KV cache.

All searches run the two phases of incremental decoding: `model.prefill(src)` encodes
the source and computes every layer's cross-attention keys and values once; each step
then feeds only the newest token through `model.decode_step`, which appends to the
self-attention caches in place.

Beam search follows the paper's settings by default: beam 4, the GNMT length penalty
lp(Y) = ((5 + |Y|) / 6)^alpha with alpha 0.6 (|Y| counts the end token), and a maximum
output length of source length + 50.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from transduce.model import Seq2SeqModel

EXTRA_LENGTH = 50  # the paper: maximum output length = input length + 50


@dataclass
class Hypothesis:
    tokens: list[int]      # generated ids, without bos and eos
    score: float           # log-probability / length penalty: what beams are ranked by
    log_prob: float        # sum of the token log-probabilities (eos included)


def length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al. 2016): ((5 + |Y|) / 6)^alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(model: Seq2SeqModel, src: Tensor, max_len: int | None) -> Tensor:
    """Per-sentence output limit: source length + 50 (or max_len), within max_positions."""
    source_lengths = (src != model.config.pad_id).sum(dim=1)
    limit = source_lengths + EXTRA_LENGTH if max_len is None else torch.full_like(source_lengths, max_len)
    return limit.clamp(max=model.config.max_positions, min=1)


@torch.no_grad()
def greedy_search(model: Seq2SeqModel, src: Tensor, *, bos_id: int, eos_id: int,
                  max_len: int | None = None, cache_dtype: torch.dtype | None = None) -> Tensor:
    """Pick the most likely token at every step until eos or the length limit.

    src (B, S) right-padded ids -> (B, L) generated ids without bos; each row ends with
    eos (unless cut at its limit) and is padded with pad_id after it.
    """
    return _step_until_done(model, src, bos_id, eos_id, max_len,
                            lambda logits: logits.argmax(dim=-1), cache_dtype)


@torch.no_grad()
def sample(model: Seq2SeqModel, src: Tensor, *, bos_id: int, eos_id: int,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           seed: int | None = None, max_len: int | None = None) -> Tensor:
    """Draw each token from softmax(logits / temperature), restricted to the top_k most
    likely tokens and to the smallest set whose probability reaches top_p (nucleus).
    Same layout as greedy_search; seeded runs repeat exactly."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (use greedy_search for 0)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    generator = torch.Generator(device=src.device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))

    def choose(logits: Tensor) -> Tensor:
        logits = logits.float() / temperature
        if top_k > 0:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token when the tokens before it already reach top_p.
            drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)

    return _step_until_done(model, src, bos_id, eos_id, max_len, choose)


def _step_until_done(model: Seq2SeqModel, src: Tensor, bos_id: int, eos_id: int,
                     max_len: int | None, choose,
                     cache_dtype: torch.dtype | None = None) -> Tensor:
    """The loop shared by greedy search and sampling: one chosen token per step."""
    pad_id = model.config.pad_id
    limits = max_lengths(model, src, max_len)                             # (B,)
    state = model.prefill(src, int(limits.max()), cache_dtype=cache_dtype)
    batch = src.shape[0]
    token = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    generated = []
    for step in range(int(limits.max())):
        logits = model.decode_step(token, state)[:, -1]                  # (B, V)
        token = choose(logits).unsqueeze(-1).masked_fill_(finished[:, None], pad_id)
        generated.append(token)
        finished |= (token[:, 0] == eos_id) | (limits <= step + 1)
        if finished.all():
            break
    return torch.cat(generated, dim=1)


@torch.no_grad()
def beam_search(model: Seq2SeqModel, src: Tensor, *, bos_id: int, eos_id: int, beam: int = 4,
                alpha: float = 0.6, nbest: int = 1, max_len: int | None = None,
                cache_dtype: torch.dtype | None = None) -> list[list[Hypothesis]]:
    """Batched beam search -> for each sentence, its nbest hypotheses, best first.

    Each step extends every live beam by every token, keeps the 2 * beam best
    extensions per sentence, moves those ending in eos among the first `beam` to the
    sentence's finished list, and continues with the best `beam` others. A sentence is
    done when it has `beam` finished hypotheses (with beam 1 this is greedy search), when
    no live beam can still beat its nbest-th finished one (the length penalty bounds what
    a beam can reach by the sentence's length limit), or at that limit. Done sentences
    leave the batch, and the caches shrink with them (KVCache.reorder).
    cache_dtype: the self-attention caches' type (default: the model's); torch.int8
    quantizes them (QuantizedKVCache).
    """
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest={nbest} must be between 1 and beam={beam}")
    device, batch = src.device, src.shape[0]
    limits = max_lengths(model, src, max_len).tolist()
    state = model.prefill(src, max(limits), cache_dtype=cache_dtype)
    state.reorder(torch.arange(batch, device=device).repeat_interleave(beam))  # (B * K) rows
    alive = list(range(batch))             # original index of each sentence still searching
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    # Only the first beam of each sentence is live at the start: the others would repeat it.
    scores = torch.full((batch, beam), float("-inf"), device=device)
    scores[:, 0] = 0.0
    history = torch.full((batch * beam, 1), bos_id, dtype=torch.long, device=device)

    for step in range(1, max(limits) + 1):
        log_probs = model.decode_step(history[:, -1:], state)[:, -1].float().log_softmax(-1)
        vocab = log_probs.shape[-1]
        candidates = (scores.view(-1, 1) + log_probs).view(len(alive), beam * vocab)
        top_scores, top_index = candidates.topk(2 * beam, dim=1)           # (A, 2K)
        top_beam, top_token = top_index // vocab, top_index % vocab
        is_eos = top_token == eos_id
        # The best `beam` candidates that do not end: rank by position, eos pushed back.
        order = (torch.arange(2 * beam, device=device) + is_eos * 2 * beam).argsort(dim=1)
        keep = order[:, :beam]                                             # (A, K)
        next_scores = top_scores.gather(1, keep)
        next_beam = top_beam.gather(1, keep)
        next_token = top_token.gather(1, keep)

        penalty = length_penalty(step, alpha)
        eos_rows, eos_ranks = (is_eos[:, :beam] & (top_scores[:, :beam] > float("-inf"))).nonzero(as_tuple=True)
        for row, rank in zip(eos_rows.tolist(), eos_ranks.tolist()):
            sentence, source_beam = alive[row], int(top_beam[row, rank])
            tokens = history[row * beam + source_beam, 1:].tolist()
            log_prob = float(top_scores[row, rank])
            finished[sentence].append(Hypothesis(tokens, log_prob / penalty, log_prob))

        still_alive: list[int] = []
        for row, sentence in enumerate(alive):
            if step >= limits[sentence]:   # cut at the limit: the live beams end here
                for k in range(beam):
                    log_prob = float(next_scores[row, k])
                    if log_prob > float("-inf"):
                        tokens = history[row * beam + int(next_beam[row, k]), 1:].tolist()
                        tokens.append(int(next_token[row, k]))
                        finished[sentence].append(Hypothesis(tokens, log_prob / penalty, log_prob))
                continue
            if _done(finished[sentence], float(next_scores[row, 0]), beam, nbest, alpha,
                     limits[sentence]):
                continue
            still_alive.append(row)
        if not still_alive:
            break

        rows = torch.tensor(still_alive, device=device)
        source_rows = (rows[:, None] * beam + next_beam[rows]).view(-1)    # (A' * K)
        history = torch.cat([history[source_rows], next_token[rows].view(-1, 1)], dim=1)
        scores = next_scores[rows]
        state.reorder(source_rows, same_source=len(still_alive) == len(alive))
        alive = [alive[row] for row in still_alive]

    for hypotheses in finished:
        hypotheses.sort(key=lambda h: h.score, reverse=True)
    return [hypotheses[:nbest] for hypotheses in finished]


def _done(finished: list[Hypothesis], best_live_log_prob: float, beam: int, nbest: int,
          alpha: float, limit: int) -> bool:
    """Whether more steps can change this sentence's nbest list."""
    if len(finished) >= beam:
        return True
    if len(finished) < nbest:
        return False
    # A live beam's log-probability only falls; dividing by the largest penalty it can
    # reach (at the length limit) bounds the score it could still finish with.
    best_possible = best_live_log_prob / length_penalty(limit, alpha)
    kth_best = sorted(h.score for h in finished)[-nbest]
    return kth_best >= best_possible
