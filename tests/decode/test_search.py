"""Beam search driven by a scripted decoder with known probabilities, and on a real model:
batched equals one-at-a-time, beam 1 equals greedy, sampling is seeded."""

import itertools
import math

import pytest
import torch

from transduce.attention import masks
from transduce.config import preset
from transduce.decode.search import (_stable_slots, beam_search, fill_holes, greedy_search,
                                     length_penalty, max_lengths, sample, top_k)
from transduce.decode.sampling import prompt_seeds
from transduce.model import Transformer

PAD, BOS, EOS = 0, 1, 2


class ScriptedDecoder:
    """A stand-in model: P(next | prefix) comes from a table; unknown prefixes are
    uniform. It implements just what the searches call."""

    def __init__(self, table, vocab=5, max_positions=64):
        self.table, self.vocab = table, vocab
        self.config = type("Config", (), {"pad_id": PAD, "max_positions": max_positions})()

    def probabilities(self, prefix):
        probs = torch.full((self.vocab,), 1e-9)
        for token, p in self.table.get(tuple(prefix), {}).items():
            probs[token] = p
        if not self.table.get(tuple(prefix)):
            probs[2:] = 1.0 / (self.vocab - 2)
        return probs / probs.sum()

    def prefill(self, src, max_len, *, src_mask=None, cache_dtype=None):
        return ScriptedState([() for _ in range(src.shape[0])])

    def decode_step(self, tokens, state):
        state.prefixes = [p + (int(t),) for p, t in zip(state.prefixes, tokens[:, -1])]
        rows = [self.probabilities(p[1:]).log() for p in state.prefixes]  # drop bos
        return torch.stack(rows)[:, None, :]


class ScriptedState:
    def __init__(self, prefixes):
        self.prefixes = prefixes

    def reorder(self, rows, sources=None):
        self.prefixes = [self.prefixes[i] for i in rows.tolist()]


# Greedy takes A (0.6) and then is stuck with 0.5 at best: 0.30. Beam search finds
# B then eos: 0.4 * 0.9 = 0.36.
A, B = 3, 4
TABLE = {(): {A: 0.6, B: 0.4}, (A,): {A: 0.5, B: 0.5}, (B,): {EOS: 0.9, A: 0.1},
         (A, A): {EOS: 1.0}, (A, B): {EOS: 1.0}}


def brute_force(model, max_len, alpha, no_doubles=False):
    """Every sequence up to max_len tokens, scored as beam search scores them (with
    no_doubles: none with a token twice in a row, each step's probabilities renormalized
    without the token before)."""
    best = []
    for length in range(1, max_len + 1):
        for body in itertools.product(range(2, model.vocab), repeat=length):
            if EOS in body[:-1] or (body[-1] != EOS and length < max_len):
                continue  # eos ends a sequence; only the length limit cuts one without it
            if no_doubles and any(a == b for a, b in zip(body, body[1:])):
                continue
            log_prob = 0.0
            for i in range(length):
                probs = model.probabilities(body[:i])
                before = probs[body[i - 1]] if no_doubles and i else 0.0   # (bos's: ~0)
                log_prob += math.log(probs[body[i]] / (1 - before))
            tokens = list(body[:-1]) if body[-1] == EOS else list(body)
            best.append((log_prob / length_penalty(length, alpha), tokens))
    return sorted(best, reverse=True)


def test_beam_finds_what_greedy_misses():
    model = ScriptedDecoder(TABLE)
    src = torch.tensor([[5, EOS]])
    greedy = greedy_search(model, src, bos_id=BOS, eos_id=EOS, max_len=5)
    assert greedy[0].tolist()[:3] in ([A, A, EOS], [A, B, EOS])
    best = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam=2, alpha=0.0, max_len=5)[0][0]
    assert best.tokens == [B] and best.log_prob == pytest.approx(math.log(0.36), rel=1e-5)


@pytest.mark.parametrize("alpha,no_doubles", [(0.0, False), (0.6, False), (1.0, False),
                                              (0.6, True)])
def test_wide_beam_equals_exhaustive_search(alpha, no_doubles):
    torch.manual_seed(3)
    table = {}
    for prefix_length in range(3):
        for prefix in itertools.product([2, 3, 4], repeat=prefix_length):
            if EOS not in prefix:
                weights = torch.rand(3) ** 3
                table[prefix] = {t: float(w) for t, w in zip([2, 3, 4], weights / weights.sum())}
    model = ScriptedDecoder(table)
    found = beam_search(model, torch.tensor([[5, EOS]]), bos_id=BOS, eos_id=EOS, beam=40,
                        alpha=alpha, nbest=5, max_len=3, no_doubles=no_doubles)[0]
    expected = brute_force(model, 3, alpha, no_doubles)[:5]
    assert [h.tokens for h in found] == [tokens for _, tokens in expected]
    assert [h.score for h in found] == pytest.approx([score for score, _ in expected], rel=1e-5)


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx(2.0 ** 0.6)
    assert length_penalty(20, 0.0) == 1.0


def test_max_length_is_source_plus_50_within_positions():
    model = Transformer(preset("tiny", src_vocab_size=20, tgt_vocab_size=20, max_positions=60))
    src = torch.tensor([[5, 6, 7, EOS, PAD], [5, EOS, PAD, PAD, PAD]])
    assert max_lengths(model, src, None).tolist() == [54, 52]
    assert max_lengths(model, torch.full((1, 30), 5), None).tolist() == [60]


def real_model(**changes):
    torch.manual_seed(11)
    return Transformer(preset("tiny", src_vocab_size=24, tgt_vocab_size=24, **changes)).eval()


def padded_sources(lengths):
    ids = torch.randint(3, 24, (len(lengths), max(lengths)))
    ids = ids.masked_fill(~masks.padding_mask(torch.tensor(lengths))[:, 0, 0], PAD)
    for row, n in enumerate(lengths):
        ids[row, n - 1] = EOS
    return ids


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 1}, {"positional": "rotary"},
                                     {"positional": "t5"}, {"positional": "alibi"}])
def test_batched_beam_equals_one_sentence_at_a_time(changes):
    model = real_model(**changes)
    src = padded_sources([9, 3, 6, 12, 2])
    batched = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam=4, nbest=2, max_len=12)
    for row in range(src.shape[0]):
        alone_src = src[row:row + 1, :int((src[row] != PAD).sum())]
        alone = beam_search(model, alone_src, bos_id=BOS, eos_id=EOS, beam=4, nbest=2, max_len=12)
        assert [h.tokens for h in batched[row]] == [h.tokens for h in alone[0]]
        assert [h.score for h in batched[row]] == pytest.approx([h.score for h in alone[0]], abs=1e-4)


def test_beam_one_equals_greedy():
    model = real_model()
    src = padded_sources([7, 4, 9, 2])
    greedy = greedy_search(model, src, bos_id=BOS, eos_id=EOS, max_len=15)
    beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam=1, max_len=15)
    for row in range(src.shape[0]):
        tokens = [t for t in greedy[row].tolist() if t not in (PAD, EOS)]
        assert beam[row][0].tokens == tokens


def test_nbest_lists_are_sorted_and_distinct():
    model = real_model()
    results = beam_search(model, padded_sources([5, 8]), bos_id=BOS, eos_id=EOS, beam=5, nbest=3,
                          max_len=10)
    for hypotheses in results:
        assert len(hypotheses) == 3
        scores = [h.score for h in hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hypotheses}) == 3
    with pytest.raises(ValueError, match="nbest=5"):
        beam_search(model, padded_sources([3]), bos_id=BOS, eos_id=EOS, beam=4, nbest=5)


def test_sampling_is_seeded_and_degenerates_to_greedy():
    model = real_model()
    src = padded_sources([6, 3])
    a = sample(model, src, bos_id=BOS, eos_id=EOS, seed=5, max_len=10)
    b = sample(model, src, bos_id=BOS, eos_id=EOS, seed=5, max_len=10)
    assert torch.equal(a, b)
    greedy = greedy_search(model, src, bos_id=BOS, eos_id=EOS, max_len=10)
    assert torch.equal(sample(model, src, bos_id=BOS, eos_id=EOS, top_k=1, seed=1, max_len=10), greedy)
    assert torch.equal(sample(model, src, bos_id=BOS, eos_id=EOS, top_p=1e-6, seed=1, max_len=10),
                       greedy)
    # min_p 1 keeps the likeliest token alone (greedy); a vanishing one leaves the seeded
    # draws as they were.
    assert torch.equal(sample(model, src, bos_id=BOS, eos_id=EOS, min_p=1.0, seed=1, max_len=10),
                       greedy)
    assert torch.equal(sample(model, src, bos_id=BOS, eos_id=EOS, min_p=1e-12, seed=5,
                              max_len=10), a)
    with pytest.raises(ValueError, match="temperature"):
        sample(model, src, bos_id=BOS, eos_id=EOS, temperature=0)
    with pytest.raises(ValueError, match="min_p"):
        sample(model, src, bos_id=BOS, eos_id=EOS, min_p=1.5)


def test_a_sampled_row_draws_the_same_alone_and_in_any_batch():
    """Row i draws from prompt_seeds(seed)[i]: alone with that seed it samples the same."""
    model = real_model().double()
    src = padded_sources([6, 3, 5, 6])
    together = sample(model, src, bos_id=BOS, eos_id=EOS, seed=5, max_len=10)
    assert len({tuple(row.tolist()) for row in together}) > 1
    for row, seed in enumerate(prompt_seeds(5, 4)):
        length = int((src[row] != PAD).sum())
        alone = sample(model, src[row:row + 1, :length], bos_id=BOS, eos_id=EOS, seed=seed,
                       max_len=10)
        assert alone[0].tolist() == together[row, :alone.shape[1]].tolist()
        assert (together[row, alone.shape[1]:] == PAD).all()


@pytest.mark.parametrize("width", [32000, 8003 * 4])   # a multiple of the block, and not
def test_block_top_k_equals_torch_topk(width):
    scores = torch.randn(5, width)
    scores[1, : width // 2] = float("-inf")               # beams not yet live
    scores[2, 7] = 100.0                                    # one entry far ahead
    values, indices = top_k(scores, 8)
    expected_values, expected_indices = scores.topk(8, dim=1)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0)
    assert torch.equal(indices, expected_indices)


def test_block_top_k_with_ties_returns_tied_entries():
    scores = torch.zeros(2, 40000)
    scores[:, 123] = scores[:, 39000] = 1.0
    values, indices = top_k(scores, 4)
    assert values.tolist() == [[1.0, 1.0, 0.0, 0.0]] * 2
    assert torch.equal(scores.gather(1, indices), values)
    assert all(set(row[:2]) == {123, 39000} for row in indices.tolist())


@pytest.mark.parametrize("source_beam,expected", [
    ([0, 1, 2, 3], [0, 1, 2, 3]),    # every beam goes on in its own row
    ([3, 2, 1, 0], [3, 2, 1, 0]),    # ranked backwards: still nobody moves
    ([0, 0, 0, 0], [0, 1, 2, 3]),    # all from beam 0 (the first step): rows 1-3 copy it
    ([2, 2, 0, 1], [2, 3, 0, 1]),    # beam 3 died; the second child of beam 2 takes row 3
])
def test_stable_slots_keep_candidates_in_their_source_rows(source_beam, expected):
    order = _stable_slots(torch.tensor([source_beam]))
    assert sorted(order[0].tolist()) == [0, 1, 2, 3]
    slot_of = {candidate: slot for slot, candidate in enumerate(order[0].tolist())}
    firsts = {beam: i for i, beam in reversed(list(enumerate(source_beam)))}
    assert all(slot_of[i] == beam for beam, i in firsts.items())
    assert order[0].tolist() == expected


def test_fill_holes_moves_only_the_last_rows():
    assert fill_holes([0, 1, 2]) == [0, 1, 2]
    assert fill_holes([0, 2, 3, 5]) == [0, 5, 2, 3]     # rows 1 and 4 finished
    assert fill_holes([4, 5]) == [4, 5]
    assert sorted(fill_holes([1, 3, 4, 6, 7])) == [1, 3, 4, 6, 7]
