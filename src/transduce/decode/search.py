"""Search over the model's output distribution, one token per step through the KV cache.

All searches run the two phases of incremental decoding: `model.prefill(src)` encodes
the source and computes every layer's cross-attention keys and values once; each step
then feeds only the newest token through `model.decode_step`, which appends to the
self-attention caches in place. A decoder-only model's prefill caches the prompt instead
(model/decoder_only.py), and its searches start from the prompt's last token where a
translation starts from bos: `start` is one id for every row, or one per row (B,).

Beam search follows the paper's settings by default: beam 4, the GNMT length penalty
lp(Y) = ((5 + |Y|) / 6)^alpha with alpha 0.6 (|Y| counts the end token), and a maximum
output length of source length + 50.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from transduce.decode import beam_step
from transduce.decode.sampling import Sampler, prompt_seeds
from transduce.model import Generative as Model

EXTRA_LENGTH = 50  # the paper: maximum output length = input length + 50
Start = int | Tensor   # the first decoder input: one id for all rows, or (B,) ids


@dataclass
class Hypothesis:
    tokens: list[int]      # generated ids, without bos and eos
    score: float           # log-probability / length penalty: what beams are ranked by
    log_prob: float        # sum of the token log-probabilities (eos included)


def length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al. 2016): ((5 + |Y|) / 6)^alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(model: Model, src: Tensor, max_len: int | Tensor | None,
                given: int = 0) -> Tensor:
    """Per-sentence output limit (B,): source length + 50, or max_len (one for all, or
    (B,) one each), within max_positions less the `given` tokens after bos
    (forced_start)."""
    source_lengths = (src != model.config.pad_id).sum(dim=1)
    if max_len is None:
        limit = source_lengths + EXTRA_LENGTH
    elif isinstance(max_len, Tensor):
        limit = max_len.to(source_lengths)
    else:
        limit = torch.full_like(source_lengths, max_len)
    return limit.clamp(max=model.config.max_positions - given, min=1)


@torch.no_grad()
def greedy_search(model: Model, src: Tensor, *, bos_id: Start, eos_id: int,
                  max_len: int | None = None, cache_dtype: torch.dtype | None = None,
                  src_mask: Tensor | None = None) -> Tensor:
    """Pick the most likely token at every step until eos or the length limit.

    src (B, S) right-padded ids -> (B, L) generated ids without bos; each row ends with
    eos (unless cut at its limit) and is padded with pad_id after it.
    """
    return _step_until_done(model, src, bos_id, eos_id, max_len,
                            lambda logits: logits.argmax(dim=-1), cache_dtype, src_mask)


@torch.no_grad()
def sample(model: Model, src: Tensor, *, bos_id: Start, eos_id: int,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           seed: int | None = None, max_len: int | None = None,
           src_mask: Tensor | None = None, min_p: float = 0.0) -> Tensor:
    """Draw each token from softmax(logits / temperature), restricted to the top_k most
    likely tokens, to the smallest set whose probability reaches top_p (nucleus) and to
    the tokens at least min_p times as likely as the likeliest. Same layout as
    greedy_search; seeded runs repeat exactly. Row i draws from a generator of its own,
    seeded prompt_seeds(seed)[i], so its sample does not depend on what else is in the
    batch."""
    rows = list(range(src.shape[0]))
    sampler = Sampler(temperature, top_k, top_p, device=src.device,
                      row_seeds=prompt_seeds(seed, len(rows)), min_p=min_p)
    return _step_until_done(model, src, bos_id, eos_id, max_len,
                            lambda logits: sampler(logits, rows), None, src_mask)


def _step_until_done(model: Model, src: Tensor, bos_id: Start, eos_id: int,
                     max_len: int | None, choose, cache_dtype: torch.dtype | None = None,
                     src_mask: Tensor | None = None) -> Tensor:
    """The loop shared by greedy search and sampling: one chosen token per step."""
    pad_id = model.config.pad_id
    limits = max_lengths(model, src, max_len)                             # (B,)
    state = model.prefill(src, int(limits.max()), src_mask=src_mask, cache_dtype=cache_dtype)
    batch = src.shape[0]
    token = start_tokens(bos_id, batch, src.device)                       # (B, 1)
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


def forced_start(model: Model, state, bos_id: Start, forced: Tensor | None) -> Start:
    """Where a search starts: bos, or, with `forced` (B, F) tokens that every output
    begins with (a multilingual model's target language), the last of them, once bos and
    the others went through the decoder into `state`. They are given, not searched: they
    count in no score, length or limit, and are not part of the hypotheses."""
    if forced is None:
        return bos_id
    batch = forced.shape[0]
    given = torch.cat([start_tokens(bos_id, batch, forced.device), forced[:, :-1]], dim=1)
    model.decode_step(given, state)
    return forced[:, -1]


def start_tokens(start: Start, batch: int, device: torch.device) -> Tensor:
    """The first decoder input of each row: bos, or a decoder-only prompt's last token
    -> (B, 1)."""
    if isinstance(start, Tensor):
        return start.reshape(batch, 1).to(device=device, dtype=torch.long)
    return torch.full((batch, 1), start, dtype=torch.long, device=device)


@torch.no_grad()
def beam_search(model: Model, src: Tensor, *, bos_id: Start, eos_id: int | Sequence[int],
                beam: int = 4,
                alpha: float = 0.6, nbest: int = 1, max_len: int | Tensor | None = None,
                cache_dtype: torch.dtype | None = None, src_mask: Tensor | None = None,
                forced: Tensor | None = None, no_doubles: bool = False
                ) -> list[list[Hypothesis]]:
    """Batched beam search -> for each sentence, its nbest hypotheses, best first.

    Each step extends every live beam by every token, keeps the 2 * beam best
    extensions per sentence, moves those ending in eos among the first `beam` to the
    sentence's finished list, and continues with the best `beam` others. A sentence is
    done when it has `beam` finished hypotheses (with beam 1 this is greedy search), when
    no live beam can still beat its nbest-th finished one (the length penalty bounds what
    a beam can reach by the sentence's length limit), or at that limit. Done sentences
    leave the batch, and their cache rows with them (KVCache.reorder).
    eos_id: the end token, or several (an instruct model's: any of them ends a hypothesis).
    max_len: new tokens at most, one limit for all or (B,) one each. cache_dtype: the
    self-attention caches' type (default: the model's); torch.int8 quantizes them
    (QuantizedKVCache). forced: (B, F) tokens every output starts with (forced_start).
    no_doubles: a token never directly follows itself (forbid_doubles).
    """
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest={nbest} must be between 1 and beam={beam}")
    device, batch = src.device, src.shape[0]
    given = 0 if forced is None else forced.shape[1]
    limits = max_lengths(model, src, max_len, given).tolist()
    state = model.prefill(src, max(limits) + given, src_mask=src_mask, cache_dtype=cache_dtype)
    start = forced_start(model, state, bos_id, forced)
    # K target rows per sentence; the source side stays one row per sentence.
    state.reorder(torch.arange(batch, device=device).repeat_interleave(beam))  # (B * K)
    alive = list(range(batch))             # original index of each sentence still searching
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    # Only the first beam of each sentence is live at the start: the others would repeat it.
    scores = torch.full((batch, beam), float("-inf"), device=device)
    scores[:, 0] = 0.0
    history = start_tokens(start, batch, device).repeat_interleave(beam, dim=0)  # (B * K, 1)

    for step in range(1, max(limits) + 1):
        logits = model.decode_step(history[:, -1:], state)[:, -1]         # (A * K, V)
        if no_doubles:
            forbid_doubles(logits, history[:, -1])
        top = best_extensions(logits, scores, beam, eos_id)
        penalties = [length_penalty(step, alpha)] * len(alive)
        prefix = history_prefix(history)
        finish_eos(top, prefix, [finished[sentence] for sentence in alive], beam, penalties)
        still_alive: list[int] = []
        best_live = top.next_scores.max(dim=1).values.tolist()
        for row, sentence in enumerate(alive):
            if step >= limits[sentence]:   # cut at the limit: the live beams end here
                finish_live(top, row, prefix, finished[sentence], beam, penalties[row])
            elif not sentence_done(finished[sentence], best_live[row], beam, nbest, alpha,
                                   limits[sentence]):
                still_alive.append(row)
        if not still_alive:
            break

        if len(still_alive) < len(alive):
            still_alive = fill_holes(still_alive)
        rows = torch.tensor(still_alive, device=device)
        source_rows = (rows[:, None] * beam + top.next_beam[rows]).view(-1)  # (A' * K)
        history = torch.cat([history[source_rows], top.next_token[rows].view(-1, 1)], dim=1)
        scores = top.next_scores[rows]
        state.reorder(source_rows, None if len(still_alive) == len(alive) else rows)
        alive = [alive[row] for row in still_alive]

    for hypotheses in finished:
        hypotheses.sort(key=lambda h: h.score, reverse=True)
    return [hypotheses[:nbest] for hypotheses in finished]


def forbid_doubles(logits: Tensor, last: Tensor) -> Tensor:
    """logits (R, V) with -inf at each row's last token (R,), in place: the token cannot
    come again at once. A briefly trained model can loop on a word ("In the beginning God
    God God created"); the same token twice in a row is rare in text (21 of the Bible
    corpus's 29,084 English training verses double a word), so forbidding it costs
    little there (not in languages that double characters, such as Chinese's 谢谢)."""
    return logits.scatter_(1, last[:, None], float("-inf"))


class Extensions(NamedTuple):
    """One step's best 2K extensions per sentence (A, 2K), best first, and the K that go
    on (A, K), placed so that most stay in their parent beam's row."""

    top_scores: Tensor
    top_beam: Tensor
    top_token: Tensor
    is_eos: Tensor
    next_scores: Tensor
    next_beam: Tensor
    next_token: Tensor


def best_extensions(logits: Tensor, scores: Tensor, beam: int,
                    eos_id: int | Sequence[int]) -> Extensions:
    """logits (A * K, V), the live beams' scores (A, K) -> the step's extensions: in one
    call of the beam step kernel on a CPU where it is built (decode/beam_step.py), else
    by PyTorch's operators (operator_extensions), the same values."""
    if logits.device.type == "cpu" and scores.dtype == torch.float32 \
            and logits.shape[-1] >= 2 and beam_step.available():
        eos_ids = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id))
        return Extensions(*beam_step.beam_extensions(logits, scores, beam, eos_ids))
    return operator_extensions(logits, scores, beam, eos_id)


def operator_extensions(logits: Tensor, scores: Tensor, beam: int,
                        eos_id: int | Sequence[int]) -> Extensions:
    """best_extensions by PyTorch's operators, on any device."""
    vocab = logits.shape[-1]
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    candidates = log_probs.add_(scores.view(-1, 1)).view(scores.shape[0], beam * vocab)
    top_scores, top_index = top_k(candidates, 2 * beam)                   # (A, 2K)
    top_beam, top_token = top_index // vocab, top_index % vocab
    is_eos = top_token == eos_id if isinstance(eos_id, int) else \
        torch.isin(top_token, torch.tensor(eos_id, device=top_token.device))
    # The best `beam` candidates that do not end: rank by position, eos pushed back.
    order = (torch.arange(2 * beam, device=logits.device) + is_eos * 2 * beam).argsort(dim=1)
    keep = order[:, :beam]                                                 # (A, K)
    keep = keep.gather(1, _stable_slots(top_beam.gather(1, keep)))
    return Extensions(top_scores, top_beam, top_token, is_eos, top_scores.gather(1, keep),
                       top_beam.gather(1, keep), top_token.gather(1, keep))


Prefix = Callable[[int], list[int]]   # a target row -> the tokens it generated so far


def history_prefix(history: Tensor) -> Prefix:
    """history (R, 1 + steps): bos, then each row's tokens -> the tokens of a row."""
    return lambda row: history[row, 1:].tolist()


def finish_eos(top: Extensions, prefix: Prefix, finished: Sequence[list[Hypothesis]],
               beam: int, penalties: Sequence[float]) -> None:
    """Candidates among each sentence's best `beam` that end in eos are finished.
    finished and penalties: those of each sentence row of top, in its order."""
    ending = top.is_eos[:, :beam] & (top.top_scores[:, :beam] > float("-inf"))
    for row, rank in zip(*(t.tolist() for t in ending.nonzero(as_tuple=True))):
        tokens = prefix(row * beam + int(top.top_beam[row, rank]))
        log_prob = float(top.top_scores[row, rank])
        finished[row].append(Hypothesis(tokens, log_prob / penalties[row], log_prob))


def finish_live(top: Extensions, row: int, prefix: Prefix, finished: list[Hypothesis],
                beam: int, penalty: float) -> None:
    """A sentence at its length limit: its live beams end here, without eos."""
    for k in range(beam):
        log_prob = float(top.next_scores[row, k])
        if log_prob > float("-inf"):
            tokens = prefix(row * beam + int(top.next_beam[row, k]))
            tokens.append(int(top.next_token[row, k]))
            finished.append(Hypothesis(tokens, log_prob / penalty, log_prob))


def top_k(scores: Tensor, k: int, block: int = 256) -> tuple[Tensor, Tensor]:
    """scores.topk(k, dim=1), faster on CPU for rows as wide as beam x vocabulary.

    The k best entries of a row lie in the k blocks (of `block` entries) with the largest
    maxima: a block holding one of them but ranked below k other blocks would mean k
    larger entries. So only those k blocks are searched: one pass of maxima instead of a
    selection over the whole row (2.5-3x faster for 32 x 32,000 on CPU).
    scores (A, N) -> values, indices (A, k), best first.
    """
    rows, width = scores.shape
    if scores.device.type != "cpu" or width <= 4 * k * block:
        return scores.topk(k, dim=1)
    padding = -width % block
    if padding:
        scores = F.pad(scores, (0, padding), value=float("-inf"))
    blocks = scores.view(rows, -1, block)                                 # (A, N / b, b)
    best_blocks = blocks.amax(dim=2).topk(k, dim=1).indices              # (A, k)
    candidates = blocks.gather(1, best_blocks[:, :, None].expand(-1, -1, block))
    values, within = candidates.flatten(1).topk(k, dim=1)                # (A, k)
    return values, best_blocks.gather(1, within // block) * block + within % block


def _stable_slots(source_beam: Tensor) -> Tensor:
    """Where to put the kept candidates so that most stay in their source beam's row.

    source_beam (A, K): the beam each kept candidate extends, best first -> order (A, K):
    slot s gets candidate order[:, s]. The first candidate from each source beam takes
    that beam's slot, whose cache rows then stay where they are; the other candidates
    fill the free slots in order. Only their rows are copied (KVCache.reorder).
    """
    sentences, beam = source_beam.shape
    positions = torch.arange(beam, device=source_beam.device)
    same = source_beam[:, :, None] == source_beam[:, None, :]            # (A, K, K)
    first = ~(same & (positions[None, :] < positions[:, None])).any(dim=2)
    claimed = (source_beam[:, :, None] == positions).any(dim=1)         # slots taken
    free = (claimed * beam + positions).argsort(dim=1)                  # free slots first
    rank = ((~first).cumsum(dim=1) - 1).clamp(min=0)
    slot = torch.where(first, source_beam, free.gather(1, rank))
    return torch.empty_like(slot).scatter_(1, slot, positions.expand(sentences, beam))


def fill_holes(kept: list[int]) -> list[int]:
    """The rows that go on, in their new order: each kept row among the first len(kept)
    stays in place, and the last kept rows fill the places of the finished ones, so that
    few cache rows move (KVCache.reorder)."""
    places = len(kept)
    staying = set(kept)
    movers = iter(row for row in kept if row >= places)
    return [place if place in staying else next(movers) for place in range(places)]


def sentence_done(finished: list[Hypothesis], best_live_log_prob: float, beam: int,
                  nbest: int, alpha: float, limit: int) -> bool:
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
