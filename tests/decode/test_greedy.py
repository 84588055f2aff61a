"""Greedy search with scores gives beam_search(beam=1)'s hypotheses: the same tokens,
log-probabilities and scores, cut at eos or at the length limit, batched or alone."""

import pytest
import torch

from transduce.config import preset
from transduce.decode.greedy import greedy_hypotheses
from transduce.decode.search import beam_search
from transduce.model import build_model

from tests.decode.test_search import A, B, BOS, EOS, PAD, ScriptedDecoder, padded_sources, \
    real_model


def assert_same(found, expected):
    assert len(found) == len(expected)
    for got, want in zip(found, expected):
        assert len(got) == len(want) == 1
        assert got[0].tokens == want[0].tokens
        assert got[0].log_prob == pytest.approx(want[0].log_prob, abs=1e-5)
        assert got[0].score == pytest.approx(want[0].score, abs=1e-5)


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 1}, {"positional": "rotary"},
                                     {"positional": "t5"}, {"positional": "alibi"}])
@pytest.mark.parametrize("max_len,alpha", [(None, 0.6), (4, 1.0), (1, 0.0)])
def test_greedy_equals_beam_one(changes, max_len, alpha):
    model = real_model(**changes)
    src = padded_sources([9, 3, 6, 12, 2, 1 + 1])
    options = dict(bos_id=BOS, eos_id=EOS, alpha=alpha, max_len=max_len)
    assert_same(greedy_hypotheses(model, src, **options),
                beam_search(model, src, beam=1, **options))


def test_greedy_without_doubles_equals_beam_one_without_them():
    """An untrained model repeats tokens; with no_doubles neither search writes one twice
    in a row, and the two still agree."""
    model = real_model()
    src = padded_sources([9, 3, 6, 12, 2, 5])
    options = dict(bos_id=BOS, eos_id=EOS, max_len=20)
    free = greedy_hypotheses(model, src, **options)
    assert any(a == b for h in free for a, b in zip(h[0].tokens, h[0].tokens[1:]))
    found = greedy_hypotheses(model, src, no_doubles=True, **options)
    assert not any(a == b for h in found for a, b in zip(h[0].tokens, h[0].tokens[1:]))
    assert_same(found, beam_search(model, src, beam=1, no_doubles=True, **options))


def test_batched_equals_one_sentence_at_a_time():
    model = real_model()
    src = padded_sources([7, 2, 11, 4, 5])
    batched = greedy_hypotheses(model, src, bos_id=BOS, eos_id=EOS, max_len=12)
    for row in range(src.shape[0]):
        alone = greedy_hypotheses(model, src[row:row + 1, :int((src[row] != PAD).sum())],
                                  bos_id=BOS, eos_id=EOS, max_len=12)
        assert_same([batched[row]], alone)


def test_known_probabilities_eos_and_the_limit():
    """Greedy takes A (0.6), B (0.7), then eos (0.9); cut at two tokens, the live token
    is kept and no eos counted."""
    model = ScriptedDecoder({(): {A: 0.6, B: 0.4}, (A,): {A: 0.3, B: 0.7},
                             (A, B): {EOS: 0.9, A: 0.1}})
    src = torch.tensor([[5, EOS]])
    options = dict(bos_id=BOS, eos_id=EOS, alpha=0.0)
    whole = greedy_hypotheses(model, src, max_len=5, **options)[0][0]
    assert whole.tokens == [A, B]
    assert whole.log_prob == pytest.approx(torch.tensor([0.6, 0.7, 0.9]).log().sum().item(),
                                           abs=1e-5)
    cut = greedy_hypotheses(model, src, max_len=2, **options)
    assert cut[0][0].tokens == [A, B]
    assert cut[0][0].log_prob == pytest.approx(torch.tensor([0.6, 0.7]).log().sum().item(),
                                               abs=1e-5)
    assert_same(cut, beam_search(model, src, beam=1, max_len=2, **options))


@pytest.mark.parametrize("arch", ["rnn-bahdanau", "rnn-luong"])
def test_rnn_models_and_quantized_caches(arch):
    torch.manual_seed(2)
    rnn = build_model(preset("tiny", arch=arch, src_vocab_size=24, tgt_vocab_size=24)).eval()
    src = padded_sources([5, 3, 8])
    options = dict(bos_id=BOS, eos_id=EOS, max_len=10)
    assert_same(greedy_hypotheses(rnn, src, **options), beam_search(rnn, src, beam=1, **options))
    model = real_model()
    options["cache_dtype"] = torch.int8
    assert_same(greedy_hypotheses(model, src, **options),
                beam_search(model, src, beam=1, **options))
