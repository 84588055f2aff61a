"""The beam step kernel (C++): each step's extensions equal PyTorch's operators' (values,
beams, tokens, which go on and in which slot) for every beam width, vocabulary size,
eos set and batch; ties rank by position; one and two threads agree; a whole beam
search gives the same hypotheses with it and without; and a build that cannot run
leaves the search to the operators."""

import pytest
import torch

from transduce.config import preset
from transduce.decode import beam_step
from transduce.decode.search import Extensions, beam_search, best_extensions, \
    operator_extensions
from transduce.model import Transformer

needs_kernel = pytest.mark.skipif(not beam_step.available(),
                                  reason="the beam step kernel could not be built here "
                                         "(g++ and ninja: scripts/install-system-packages.sh)")


def by_kernel(logits, scores, beam, eos):
    eos_ids = torch.tensor([eos] if isinstance(eos, int) else eos)
    return Extensions(*beam_step.beam_extensions(logits, scores, beam, eos_ids))


def assert_same(got: Extensions, expected: Extensions):
    for name, a, b in zip(Extensions._fields, got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def case(sentences, beam, vocab, seed, first_step=False, eos_boost=0.0, eos=(2,)):
    """Logits (A * K, V) and scores (A, K) without ties among the 2K best."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(sentences * beam, vocab, generator=generator) * 3
    logits[:, list(eos)] += eos_boost
    scores = -torch.rand(sentences, beam, generator=generator) * 10
    if first_step:                 # only the first beam is live at the first step
        scores[:, 1:] = float("-inf")
    return logits, scores


@needs_kernel
@pytest.mark.parametrize("beam, vocab, first_step", [
    (beam, vocab, first_step) for beam in (1, 2, 4, 5) for vocab in (3, 15, 16, 17, 100, 8000)
    for first_step in (False, True)
    if not (first_step and vocab < 2 * beam)])     # else -inf ties, ranked by position
def test_extensions_equal_the_operators(beam, vocab, first_step):
    for seed in range(4):
        logits, scores = case(3, beam, vocab, seed, first_step)
        assert_same(by_kernel(logits, scores, beam, 2),
                    operator_extensions(logits, scores, beam, 2))


@needs_kernel
@pytest.mark.parametrize("eos", [(0,), (1, 2, 3)])
@pytest.mark.parametrize("boost", [0.0, 4.0, 12.0])
def test_likely_ends_finish_and_too_few_others_go_on_with_ends(eos, boost):
    """With several likely end tokens, fewer than K of the 2K best may go on: the
    best ending ones fill the rest, as the operators' ordering gives."""
    for seed in range(6):
        logits, scores = case(4, 4, 40, seed, eos_boost=boost, eos=eos)
        expected = operator_extensions(logits, scores, 4, list(eos))
        got = by_kernel(logits, scores, 4, list(eos))
        assert_same(got, expected)
        if boost == 12.0 and len(eos) == 3:
            assert expected.is_eos.sum(dim=1).max() > 4       # the case is reached


@needs_kernel
def test_extensions_of_bfloat16_logits_equal_the_operators():
    logits, scores = case(2, 4, 300, 0)
    logits = logits.bfloat16()
    assert_same(by_kernel(logits, scores, 4, 2), operator_extensions(logits, scores, 4, 2))


@needs_kernel
def test_equal_candidates_rank_by_beam_then_token():
    logits = torch.zeros(2, 40)          # every candidate of a beam equal
    logits[1, 7] = logits[1, 9] = 1.0    # two equal best ones in beam 1
    scores = torch.zeros(1, 2)
    got = by_kernel(logits, scores, 2, 39)
    assert got.top_beam.tolist() == [[1, 1, 0, 0]]
    assert got.top_token.tolist() == [[7, 9, 0, 1]]


@needs_kernel
def test_rows_split_over_threads_equal_one_thread():
    logits, scores = case(40, 4, 1000, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = by_kernel(logits, scores, 4, 2)
        torch.set_num_threads(2)
        assert_same(by_kernel(logits, scores, 4, 2), alone)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_best_extensions_takes_the_kernel_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(beam_step, "beam_extensions",
                        lambda *args: calls.append(args) or beam_step_call(*args))
    logits, scores = case(2, 4, 50, 1)
    assert_same(best_extensions(logits, scores, 4, [2, 3]),
                operator_extensions(logits, scores, 4, [2, 3]))
    assert len(calls) == 1 and calls[0][3].tolist() == [2, 3]


def beam_step_call(*args):
    return torch.ops.transduce.beam_extensions(*args)


@needs_kernel
@pytest.mark.parametrize("nbest", [1, 3])
def test_a_beam_search_finds_the_same_hypotheses_with_and_without_the_kernel(
        monkeypatch, nbest):
    torch.manual_seed(0)
    config = preset("tiny", src_vocab_size=30, tgt_vocab_size=30, max_positions=64)
    model = Transformer(config).eval()
    src = torch.randint(3, 30, (5, 9))
    src[2, 5:] = 0
    src[4, 3:] = 0
    searches = []
    for kernel in (True, False):
        monkeypatch.setattr(beam_step, "available", lambda kernel=kernel: kernel)
        searches.append(beam_search(model, src, bos_id=1, eos_id=2, beam=4, nbest=nbest,
                                    max_len=12))
    for with_kernel, without in zip(*searches):
        assert [(h.tokens, h.score, h.log_prob) for h in with_kernel] == \
            [(h.tokens, h.score, h.log_prob) for h in without]


@needs_kernel
def test_malformed_calls_are_refused_by_name():
    logits, scores = case(2, 4, 50, 0)
    with pytest.raises(RuntimeError, match=r"logits \(A \* K, V\)"):
        beam_step.beam_extensions(logits[:7], scores, 4, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="float32 scores"):
        beam_step.beam_extensions(logits, scores.double(), 4, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="eos_ids"):
        beam_step.beam_extensions(logits, scores, 4, torch.tensor([2.0]))
    with pytest.raises(RuntimeError, match="fewer candidates"):
        beam_step.beam_extensions(torch.randn(4, 1), torch.zeros(1, 4), 4, torch.tensor([0]))


def test_without_the_kernel_callers_are_told_and_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(beam_step.KERNEL, "loaded", False)
    with pytest.raises(RuntimeError, match="not built here"):
        beam_step.beam_extensions(torch.zeros(4, 8), torch.zeros(1, 4), 4, torch.tensor([2]))
    logits, scores = case(2, 4, 50, 0)
    assert_same(best_extensions(logits, scores, 4, 2),
                operator_extensions(logits, scores, 4, 2))
    monkeypatch.setattr(beam_step.KERNEL, "loaded", None)
    monkeypatch.setenv(beam_step.SWITCH, "0")
    assert not beam_step.available()
