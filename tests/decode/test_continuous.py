"""Continuous batching: sentences joining a running beam search at any step get what
beam_search gives each alone, through compaction and growth of the buffers."""

import pytest
import torch

from transduce.config import preset
from transduce.decode.continuous import ContinuousBeamSearch, supports
from transduce.decode.search import beam_search
from transduce.model import Transformer
from transduce.model import int8 as int8_module
from transduce.model.packed import decoding_copy

from tests.decode.test_search import BOS, EOS, PAD, padded_sources, real_model


def alone(model, src_row, **options):
    """beam_search on one sentence, its padding cut."""
    src = src_row[None, :int((src_row != PAD).sum())]
    return beam_search(model, src, bos_id=BOS, eos_id=EOS, **options)[0]


def run_schedule(search, src, joins):
    """Add sentence i (row i of src) before step joins[i]; step until all are done ->
    {i: hypotheses}, and the most slots the buffers held."""
    results, step, most_slots = {}, 0, 0
    waiting = sorted(range(len(joins)), key=lambda i: joins[i])
    while waiting or search.running:
        joining = [i for i in waiting if joins[i] <= step]
        if joining:
            rows = src[joining]
            width = int((rows != PAD).sum(dim=1).max())
            search.add(rows[:, :width], joining)
            waiting = [i for i in waiting if i not in joining]
        for tag, hypotheses in search.step():
            assert tag not in results
            results[tag] = hypotheses
        most_slots = max(most_slots, search._history.shape[1])
        step += 1
    return results, most_slots


def assert_same(found, expected, tolerance=1e-4):
    assert [h.tokens for h in found] == [h.tokens for h in expected]
    assert [h.score for h in found] == pytest.approx([h.score for h in expected], abs=tolerance)
    assert [h.log_prob for h in found] == pytest.approx([h.log_prob for h in expected],
                                                        abs=tolerance)


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 1}, {"positional": "rotary"},
                                     {"positional": "t5"}, {"positional": "alibi"},
                                     {"positional": "learned"}])
@pytest.mark.parametrize("written_out", [False, True])
def test_sentences_joining_at_any_step_get_what_they_get_alone(changes, written_out):
    """written_out: a decoding copy, whose step (where it covers the layout) reads each
    run of sentences' own slots; the modules mask the slots a row does not own."""
    model = decoding_copy(real_model(**changes)) if written_out else real_model(**changes)
    torch.manual_seed(3)
    lengths = [9, 3, 6, 12, 2, 7, 1 + 4, 10]
    src = padded_sources(lengths)
    joins = [0, 0, 2, 3, 3, 7, 8, 15]
    search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, beam=4, nbest=2, max_len=12)
    results, _ = run_schedule(search, src, joins)
    assert sorted(results) == list(range(len(lengths)))
    for i in range(len(lengths)):
        assert_same(results[i], alone(model, src[i], beam=4, nbest=2, max_len=12))


@pytest.mark.parametrize("beam,nbest,alpha,no_doubles", [
    (1, 1, 0.6, False), (3, 3, 1.0, False), (5, 1, 0.0, False), (4, 2, 0.6, True)])
def test_search_settings_as_beam_search(beam, nbest, alpha, no_doubles):
    model = real_model()
    src = padded_sources([4, 8, 2, 6])
    search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, beam=beam, nbest=nbest,
                                  alpha=alpha, max_len=10, no_doubles=no_doubles)
    results, _ = run_schedule(search, src, [0, 1, 1, 5])
    for i in range(4):
        assert_same(results[i], alone(model, src[i], beam=beam, nbest=nbest, alpha=alpha,
                                      max_len=10, no_doubles=no_doubles))
    if no_doubles:
        assert not any(a == b for i in range(4) for h in results[i]
                       for a, b in zip(h.tokens, h.tokens[1:]))


@pytest.mark.parametrize("written_out", [False, True])
def test_a_long_stream_compacts_its_slots_and_stays_exact(written_out):
    """Sixty sentences joining two per step: the slots are compacted, not grown without
    end, and every result still equals beam_search alone (the default length limit,
    source + 50, also reached by some)."""
    model = decoding_copy(real_model()) if written_out else real_model()
    torch.manual_seed(5)
    lengths = torch.randint(2, 10, (60,)).tolist()
    src = padded_sources(lengths)
    search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, beam=2)
    results, most_slots = run_schedule(search, src, [i // 2 for i in range(60)])
    assert most_slots <= 2 * (max(lengths) + 50) + 2   # far below the ~90 steps run
    for i in range(60):
        assert_same(results[i], alone(model, src[i], beam=2))
    assert search.running == 0 and search.slot == 0


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.int4])
def test_quantized_caches_decode_continuously_as_alone(cache_dtype):
    """int8 and int4 keys and values with their scales in the slot buffers: moved with
    the beams, compacted and grown, each sentence as beam_search with that cache. The
    same tokens; a log-probability within 1e-4 of its size (measured: 2e-5 int8, 5e-5
    int4, where float32 caches give 6e-7): a key computed in other company differs in
    its last bits, and one at a rounding boundary then takes the next integer."""
    model = real_model()
    torch.manual_seed(6)
    lengths = torch.randint(2, 10, (24,)).tolist()
    src = padded_sources(lengths)
    search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, beam=3, nbest=2,
                                  cache_dtype=cache_dtype)
    assert search.caches[0]._buffers == ("k", "v", "k_scale", "v_scale")
    results, most_slots = run_schedule(search, src, [i // 2 for i in range(24)])
    assert most_slots <= 2 * (max(lengths) + 50) + 2
    for i in range(24):
        expected = alone(model, src[i], beam=3, nbest=2, cache_dtype=cache_dtype)
        assert [h.tokens for h in results[i]] == [h.tokens for h in expected]
        assert [h.log_prob for h in results[i]] == \
            pytest.approx([h.log_prob for h in expected], rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_packed_decoding_copy_decodes_continuously(dtype, monkeypatch):
    if dtype == torch.int8:
        if not int8_module.int8_available():
            pytest.skip("no oneDNN int8 ops in this build")
        monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)    # every product in int8
    model = decoding_copy(real_model(), dtype)
    torch.manual_seed(7)                  # the sources, whatever the copy drew or did not
    src = padded_sources([5, 9, 3])
    search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, beam=4, max_len=12)
    results, _ = run_schedule(search, src, [0, 2, 4])
    # int8: a row's activations are quantized on their own, but what reaches a product
    # can differ in its last bits with its batch mates and move a value by a step
    # (model/int8.py); with every product of this tiny model in int8, a score then
    # moves by up to 1e-2 (seen on other sources).
    for i in range(3):
        assert_same(results[i], alone(model, src[i], beam=4, max_len=12),
                    1e-2 if dtype == torch.int8 else 1e-4)


def test_models_without_plain_kv_caches_are_refused():
    torch.manual_seed(0)
    local = Transformer(preset("tiny", src_vocab_size=24, tgt_vocab_size=24,
                               attention_type="sliding", attention_window=4))
    assert supports(real_model()) and not supports(local) and not supports(object())
    assert supports(real_model(), torch.int4) and not supports(local, torch.int8)
    with pytest.raises(ValueError, match="cannot decode continuously"):
        ContinuousBeamSearch(local, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="nbest=5"):
        ContinuousBeamSearch(real_model(), bos_id=BOS, eos_id=EOS, beam=4, nbest=5)
    search = ContinuousBeamSearch(real_model(), bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="one tag per row"):
        search.add(padded_sources([3, 4]), ["only one"])
    assert search.step() == []
