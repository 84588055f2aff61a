"""Translation jobs in a continuous-batching stream: each job is answered when its last
text is done, with what offline translation gives; other translators batch whole."""

import pytest

from transduce import load
from transduce.serve.batcher import Job
from transduce.serve.continuous import translation_stream

from tests.serve.conftest import SENTENCES


def job(texts):
    return Job(("translate",), lambda jobs: [], texts, 10 * len(texts), len(texts))


def run(stream, waves):
    """Admit each wave of jobs before a step, then step until all are answered ->
    {job: result} and the step at which each was answered."""
    answered, when, step = {}, {}, 0
    waves = list(waves)
    while waves or stream.running:
        if waves:
            stream.admit(waves.pop(0))
        for done, result in stream.step():
            answered[done], when[done] = result, step
        step += 1
    return answered, when


@pytest.mark.parametrize("beam,nbest", [(4, 2), (1, 1)])
def test_jobs_get_what_offline_translation_gives(translator, beam, nbest):
    assert translator.decodes_continuously
    stream = translation_stream(translator, beam, 0.6, nbest, None)(0)
    jobs = [job(SENTENCES[:3]), job(["", SENTENCES[3]]), job([""]), job(SENTENCES[4:])]
    answered, when = run(stream, [jobs[:2], [jobs[2]], [], [jobs[3]]])
    assert when[jobs[2]] == 1                  # only an empty text: answered at once
    for each in jobs:
        results, started, seconds = answered[each]
        expected = translator.translate_nbest(each.payload, nbest, beam=beam)
        # Scores to float rounding: the stream's rows attend in other company.
        assert [[t.text for t in hypotheses] for hypotheses in results] \
            == [[t.text for t in hypotheses] for hypotheses in expected]
        assert [[t.score for t in hypotheses] for hypotheses in results] \
            == [pytest.approx([t.score for t in hypotheses], abs=1e-4) for hypotheses in expected]
        assert seconds >= 0 and started > 0


def test_bfloat16_jobs_are_all_answered(translation_dir):
    """In bfloat16 any batching changes some outputs (static batches too), so only the
    answers' shape is checked."""
    translator = load(translation_dir, dtype="bfloat16")
    stream = translation_stream(translator, 3, 0.6, 2, None)(0)
    jobs = [job(SENTENCES[:5]), job([""] + SENTENCES[5:])]
    answered, _ = run(stream, [jobs[:1], [], [jobs[1]]])
    for each in jobs:
        results = answered[each][0]
        assert len(results) == len(each.payload)
        assert all(len(hypotheses) == 2 for hypotheses in results)


def test_quantized_caches_are_batched_whole(translation_dir):
    quantized = load(translation_dir, kv_dtype="int8")
    assert not quantized.decodes_continuously
    assert translation_stream(quantized, 4, 0.6, 1, None) is None
