"""Decoding processes: a stream decoded in another process answers what the same stream
in this process does; one stream follows another; a process that cannot load, fails a
job or dies says so, and the next stream on it works."""

import functools
import os
import signal

import pytest

from transduce import load
from transduce.serve.batcher import Job
from transduce.serve.continuous import translation_stream
from transduce.serve.processes import DecoderProcess, DecoderProcessFailed

from tests.serve.conftest import SENTENCES


def job(texts):
    return Job(("translate",), lambda jobs: [], texts, 10 * len(texts), len(texts))


def run(stream, waves):
    """Admit each wave of jobs before a step, then step until all are answered ->
    {job: [[(text, score)] per text]}."""
    answered, waves = {}, list(waves)
    while waves or stream.running:
        if waves:
            stream.admit(waves.pop(0))
        for done, (results, started, seconds) in stream.step():
            assert seconds >= 0 and started > 0
            answered[done] = [[(t.text, t.score) for t in hypotheses]
                              for hypotheses in results]
    return answered


@pytest.fixture(scope="module")
def process(translation_dir):
    process = DecoderProcess(functools.partial(load, translation_dir), 0)
    process.start()
    yield process
    process.close()


def waves():
    jobs = [job(SENTENCES[:3]), job(["", SENTENCES[3]]), job([""]), job(SENTENCES[4:])]
    return jobs, [jobs[:2], [jobs[2]], [], [jobs[3]]]


@pytest.mark.parametrize("beam,nbest,no_doubles", [(4, 2, False), (1, 1, False),
                                                   (4, 1, True)])
def test_a_process_answers_what_the_stream_in_this_process_does(translator, process, beam,
                                                                 nbest, no_doubles):
    here_jobs, here_waves = waves()
    there_jobs, there_waves = waves()
    here = run(translation_stream(translator, beam, 0.6, nbest, None,
                                  no_doubles=no_doubles)(0), here_waves)
    remote = translation_stream(translator, beam, 0.6, nbest, None, {0: process},
                                no_doubles=no_doubles)(0)
    assert type(remote).__name__ == "RemoteTranslationStream"
    there = run(remote, there_waves)
    # The process steps without waiting for this one, so jobs join at other steps: the
    # same texts; scores within last-bit differences (their keys sit at other slots).
    for there_job, here_job in zip(there_jobs, here_jobs):
        assert [[t for t, _ in h] for h in there[there_job]] \
            == [[t for t, _ in h] for h in here[here_job]]
        assert [[s for _, s in h] for h in there[there_job]] \
            == [pytest.approx([s for _, s in h], abs=1e-3) for h in here[here_job]]
    assert len(there[there_jobs[0]]) == 3 and len(there[there_jobs[0]][0]) == nbest


def test_streams_follow_one_another_on_a_process_whatever_its_cores(process):
    stream = process.stream(4, 0.6, 1, None)
    stream.use_cores(1)
    first = run(stream, [[job(SENTENCES[:2])]])
    stream = process.stream(4, 0.6, 1, None)              # a new stream, the same process
    stream.use_cores(2)
    again = run(stream, [[job(SENTENCES[:2])]])
    assert list(first.values()) == list(again.values())


def test_an_error_in_the_process_fails_its_stream_only(process):
    stream = process.stream(4, 0.6, 1, None)
    stream.admit([Job(("translate",), lambda jobs: [], 12345, 10, 1)])   # no texts: fails
    with pytest.raises(TypeError):
        stream.step()
    assert run(process.stream(4, 0.6, 1, None), [[job(SENTENCES[:1])]])


def test_a_process_that_dies_fails_its_jobs_and_is_started_again(translation_dir):
    process = DecoderProcess(functools.partial(load, translation_dir), 3)
    process.start()
    try:
        stream = process.stream(4, 0.6, 1, None)
        os.kill(process._process.pid, signal.SIGKILL)
        process._process.join()
        with pytest.raises(DecoderProcessFailed, match="decoding process 3 exited"):
            stream.admit([job(SENTENCES[:1])])
            stream.step()
        assert run(process.stream(4, 0.6, 1, None), [[job(SENTENCES[:1])]])   # started again
    finally:
        process.close()


def test_a_process_that_cannot_load_says_why(tmp_path):
    process = DecoderProcess(functools.partial(load, tmp_path / "missing"), 1)
    with pytest.raises(DecoderProcessFailed, match="decoding process 1 could not load"):
        process.start()
    process.close()
