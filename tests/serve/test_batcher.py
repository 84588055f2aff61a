"""The batching worker on its own: keys never mix, the token budget and the window hold,
the queue is bounded and drains on close, errors reach every request of their batch."""

import threading
import time

import pytest

from transduce.serve.batcher import JOIN_GROUP, JOIN_WAIT_STEPS, MAX_LANES, SPLIT_AT, Batcher, \
    Closed, Job, QueueFull, _Lane
from transduce.serve.metrics import Metrics


class Recorder:
    """A batch runner that records each batch's keys and payloads; `gate` holds it."""

    def __init__(self):
        self.batches: list[list] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, jobs):
        self.gate.wait(5)
        self.batches.append([(job.key, job.payload) for job in jobs])
        return [f"done {job.payload}" for job in jobs]


def make(recorder=None, **settings):
    settings = {"batch_tokens": 100, "window_s": 0.05, "max_queue": 100, **settings}
    batcher = Batcher(Metrics(), **settings)
    return batcher, recorder or Recorder()


def job(recorder, key, payload, tokens=10):
    return Job(key, recorder, payload, tokens, 1)


def test_jobs_of_one_key_share_a_batch_and_keys_never_mix():
    batcher, run = make()
    run.gate.clear()
    batcher.start()
    try:
        first = batcher.submit(job(run, "a", 0))
        time.sleep(0.1)            # past the window: the worker holds job 0 behind the gate
        futures = [batcher.submit(job(run, key, i)) for i, key in
                   enumerate(["a", "b", "a", "b", "a"], start=1)]
        run.gate.set()
        assert first.result(5) == "done 0"
        assert [f.result(5) for f in futures] == [f"done {i}" for i in range(1, 6)]
    finally:
        batcher.close(5)
    assert run.batches[0] == [("a", 0)]
    assert run.batches[1:] == [[("a", 1), ("a", 3), ("a", 5)], [("b", 2), ("b", 4)]]


def test_the_token_budget_caps_a_batch_but_never_refuses_a_big_job():
    batcher, run = make(batch_tokens=25)
    run.gate.clear()
    batcher.start()
    try:
        futures = [batcher.submit(job(run, "k", i, tokens)) for i, tokens in
                   enumerate([10, 10, 10, 500, 1])]
        run.gate.set()
        [f.result(5) for f in futures]
    finally:
        batcher.close(5)
    sizes = [[payload for _, payload in batch] for batch in run.batches]
    assert sorted(p for batch in sizes for p in batch) == [0, 1, 2, 3, 4]
    assert all(len(batch) == 1 or sum([10, 10, 10, 500, 1][p] for p in batch) <= 25
               for batch in sizes)
    assert [3] in sizes


def test_the_window_collects_requests_that_arrive_soon_after():
    batcher, run = make(window_s=0.2)
    batcher.start()
    try:
        first = batcher.submit(job(run, "k", 0))
        time.sleep(0.05)
        second = batcher.submit(job(run, "k", 1))
        assert (first.result(5), second.result(5)) == ("done 0", "done 1")
    finally:
        batcher.close(5)
    assert run.batches == [[("k", 0), ("k", 1)]]


def test_with_nobody_else_coming_a_job_does_not_wait_for_the_window():
    batcher, run = make(window_s=2.0, others_coming=lambda: False)
    batcher.start()
    try:
        started = time.monotonic()
        assert batcher.submit(job(run, "k", 0)).result(5) == "done 0"
        assert time.monotonic() - started < 1.0
    finally:
        batcher.close(5)


def test_without_batching_one_job_at_a_time():
    batcher, run = make(batching=False)
    run.gate.clear()
    batcher.start()
    try:
        futures = [batcher.submit(job(run, "k", i)) for i in range(4)]
        run.gate.set()
        [f.result(5) for f in futures]
    finally:
        batcher.close(5)
    assert run.batches == [[("k", i)] for i in range(4)]


def test_a_full_queue_refuses_with_a_retry_estimate_and_close_drains():
    batcher, run = make(max_queue=2)
    run.gate.clear()
    batcher.start()
    held = batcher.submit(job(run, "busy", "held"))
    time.sleep(0.1)                          # taken by the worker: the queue is empty
    queued = [batcher.submit(job(run, "k", i)) for i in range(2)]
    with pytest.raises(QueueFull) as refused:
        batcher.submit(job(run, "k", 9))
    assert refused.value.retry_after >= 1
    closing = threading.Thread(target=batcher.close, args=(5,))
    closing.start()
    time.sleep(0.05)
    with pytest.raises(Closed):
        batcher.submit(job(run, "k", 10))
    run.gate.set()
    closing.join(5)
    assert held.result(0) == "done held" and [f.result(0) for f in queued] == ["done 0", "done 1"]
    assert not any(thread.is_alive() for thread in batcher._threads)


def test_an_error_reaches_every_job_of_its_batch_and_the_worker_goes_on():
    batcher, run = make()

    def failing(jobs):
        raise ValueError("boom")

    batcher.start()
    try:
        bad = [batcher.submit(Job("x", failing, i, 1, 1)) for i in range(2)]
        for future in bad:
            with pytest.raises(ValueError, match="boom"):
                future.result(5)
        assert batcher.submit(job(run, "k", 1)).result(5) == "done 1"
    finally:
        batcher.close(5)


def test_a_cancelled_job_is_skipped():
    batcher, run = make()
    run.gate.clear()
    batcher.start()
    try:
        batcher.submit(job(run, "busy", "held"))
        time.sleep(0.05)
        cancelled = batcher.submit(job(run, "k", 1))
        kept = batcher.submit(job(run, "k", 2))
        assert cancelled.cancel()
        run.gate.set()
        assert kept.result(5) == "done 2"
    finally:
        batcher.close(5)
    assert [("k", 1)] not in run.batches and [("k", 2)] in run.batches


def test_metrics_count_batches_and_queue_depth():
    batcher, run = make()
    batcher.start()
    try:
        [f.result(5) for f in [batcher.submit(job(run, "k", i)) for i in range(3)]]
    finally:
        batcher.close(5)
    text = batcher.metrics.render()
    assert "transduce_sentences_total 3" in text
    assert "transduce_queue_depth 0" in text
    assert 'transduce_batch_sentences_bucket{le="+Inf"}' in text


class CountdownStream:
    """A Stream whose job `payload` steps long, each step 5 ms: records which jobs ran
    at each step."""

    instances: list["CountdownStream"] = []

    def __init__(self, fail_at: int | None = None):
        self.left: dict[Job, int] = {}
        self.steps: list[list] = []
        self.fail_at = fail_at
        CountdownStream.instances.append(self)

    @property
    def running(self) -> int:
        return len(self.left)

    def admit(self, jobs):
        for job in jobs:
            self.left[job] = job.payload

    def step(self):
        time.sleep(0.005)
        if self.fail_at is not None and len(self.steps) == self.fail_at:
            raise RuntimeError("step failed")
        self.steps.append(sorted((job.key, job.payload) for job in self.left))
        for job in self.left:
            self.left[job] -= 1
        done = [job for job, left in self.left.items() if left <= 0]
        for job in done:
            del self.left[job]
        return [(job, f"streamed {job.payload}") for job in done]


def stream_job(key, steps, tokens=10, stream=CountdownStream):
    """A job whose stream is stream() on any decoder."""
    return Job(key, lambda jobs: [f"batched {job.payload}" for job in jobs], steps, tokens, 1,
               stream=lambda rank: stream())


def test_streamed_jobs_join_between_steps_and_leave_when_done():
    """A job queued while a stream runs joins it at the next step (a batch would have
    waited for the longest job); one of another key runs in a lane of its own beside it."""
    CountdownStream.instances.clear()
    batcher, _ = make(window_s=0.0)
    batcher.start()
    try:
        long = batcher.submit(stream_job("k", 30))
        while not CountdownStream.instances or len(CountdownStream.instances[0].steps) < 2:
            time.sleep(0.001)
        short = batcher.submit(stream_job("k", 2))
        assert short.result(5) == "streamed 2"
        assert not long.done()                   # answered before the long job is
        other = batcher.submit(stream_job("other", 1))
        assert other.result(5) == "streamed 1" and not long.done()
        assert long.result(5) == "streamed 30"
    finally:
        batcher.close(5)
    first, second = CountdownStream.instances
    assert [("k", 2), ("k", 30)] in first.steps and len(first.steps) == 30
    assert all(("other", 1) not in step for step in first.steps)
    assert second.steps == [[("other", 1)]]
    assert batcher._seconds_per_job != 0.05     # Retry-After follows the streams' pace
    text = batcher.metrics.render()
    assert "transduce_sentences_total 3" in text and "transduce_batches_total 31" in text


def test_the_token_budget_caps_a_stream_and_static_batches_ignore_streams():
    CountdownStream.instances.clear()
    batcher, _ = make(window_s=0.0, batch_tokens=25)
    batcher.start()
    try:
        futures = [batcher.submit(stream_job("k", 3)) for _ in range(3)]
        assert [f.result(5) for f in futures] == ["streamed 3"] * 3
    finally:
        batcher.close(5)
    assert max(len(step) for s in CountdownStream.instances for step in s.steps) == 2
    whole, _ = make(continuous=False)
    whole.start()
    try:
        assert whole.submit(stream_job("k", 3)).result(5) == "batched 3"
    finally:
        whole.close(5)


class SlowStream(CountdownStream):
    """A CountdownStream whose steps take 30 ms, each noted in `log` with its time."""

    log: list[tuple[str, float]] = []

    def step(self):
        time.sleep(0.025)
        SlowStream.log.append(("slow", time.monotonic()))
        return super().step()


def test_a_short_search_of_other_settings_is_not_held_by_a_long_one():
    """A short job of another key opens a lane at the next step and has steps by turns,
    the lane with the least time first: its five 5 ms steps pass while the 30 ms lane
    steps about once, not after its hundred steps."""
    CountdownStream.instances.clear()
    SlowStream.log.clear()
    batcher, _ = make(window_s=0.0)
    batcher.start()
    try:
        long = batcher.submit(stream_job("slow", 100, stream=SlowStream))
        while len(SlowStream.log) < 3:
            time.sleep(0.001)
        queued = time.monotonic()
        short = batcher.submit(stream_job("fast", 5))
        assert short.result(5) == "streamed 5"
        answered = time.monotonic()
        assert not long.done()
        assert long.result(10) == "streamed 100"
    finally:
        batcher.close(5)
    slow_steps_meanwhile = [t for _, t in SlowStream.log if queued <= t <= answered]
    assert len(slow_steps_meanwhile) <= 3
    slow, fast = CountdownStream.instances
    assert len(fast.steps) == 5 and all(step == [("fast", 5)] for step in fast.steps)


def test_a_failing_lane_fails_only_its_jobs():
    CountdownStream.instances.clear()
    batcher, _ = make(window_s=0.0)
    failing = lambda: CountdownStream(fail_at=3)    # noqa: E731
    batcher.start()
    try:
        fine = batcher.submit(stream_job("fine", 8))
        bad = batcher.submit(stream_job("bad", 5, stream=failing))
        with pytest.raises(RuntimeError, match="step failed"):
            bad.result(5)
        assert fine.result(5) == "streamed 8"
    finally:
        batcher.close(5)
    assert batcher._streamed == 0


def test_a_fault_outside_a_step_fails_every_running_job_and_the_worker_goes_on():
    class Faulty(CountdownStream):
        @property
        def running(self):
            if self.steps:
                raise RuntimeError("running failed")
            return len(self.left)

    batcher, _ = make(window_s=0.0)
    batcher.start()
    try:
        with pytest.raises(RuntimeError, match="running failed"):
            batcher.submit(stream_job("x", 5, stream=Faulty)).result(5)
        assert batcher.submit(stream_job("k", 1)).result(5) == "streamed 1"
    finally:
        batcher.close(5)
    assert batcher._streamed == 0


def test_a_failing_stream_fails_its_running_jobs_and_the_worker_goes_on():
    batcher, _ = make(window_s=0.0)
    failing = lambda: CountdownStream(fail_at=1)    # noqa: E731
    batcher.start()
    try:
        bad = [batcher.submit(stream_job("x", 5, stream=failing)) for _ in range(2)]
        for future in bad:
            with pytest.raises(RuntimeError, match="step failed"):
                future.result(5)
        assert batcher.submit(stream_job("k", 1)).result(5) == "streamed 1"
    finally:
        batcher.close(5)


def running_lane(key, stream=CountdownStream, tokens=0):
    """A lane of `key` whose stream runs one job."""
    lane = _Lane(key, stream(), tokens=tokens)
    lane.stream.admit([stream_job(key, 5)])
    return lane


def queue_up(batcher, jobs):
    for each in jobs:
        batcher.submit(each)                    # not started: the jobs stay queued
    return jobs


def test_newcomers_join_a_running_stream_in_groups():
    """Between steps, queued jobs of a lane's key join it only in groups of JOIN_GROUP
    sentences, or one by one once they have waited JOIN_WAIT_STEPS steps."""
    batcher, _ = make(window_s=0.0)
    queued = queue_up(batcher, [Job("k", lambda jobs: [], i, 10, 1 + i) for i in range(2)])
    lanes = {"k": running_lane("k")}
    assert sum(job.sentences for job in queued) < JOIN_GROUP
    for held in range(JOIN_WAIT_STEPS):
        assert batcher._admissions(lanes) == ([], {"k": []})
        assert lanes["k"].held == held + 1 and list(batcher._queue) == queued
    assert batcher._admissions(lanes) == ([], {"k": queued})
    assert not batcher._queue and lanes["k"].held == 0


def test_nothing_joins_past_a_job_that_waits():
    """Jobs join within their lane's token room; the first that cannot join opens a lane
    where its key may have one, and no job behind it is taken."""
    batcher, _ = make(window_s=0.0)
    lanes = {"k": running_lane("k", tokens=85)}
    lanes["k"].held = JOIN_WAIT_STEPS                           # no waiting for a group
    first, second, other, third = queue_up(batcher, [
        stream_job("k", 1), stream_job("k", 1), stream_job("other", 1), stream_job("k", 1)])
    opening, joining = batcher._admissions(lanes)   # 15 tokens of room: one job joins
    assert (opening, joining) == ([], {"k": [first]}) and list(batcher._queue)[0] is second
    lanes["k"].tokens, lanes["k"].held = 0, JOIN_WAIT_STEPS
    opening, joining = batcher._admissions(lanes)
    assert opening == [other] and joining == {"k": [second]}    # the third waits for it
    assert list(batcher._queue) == [third]


def test_a_key_waits_while_every_lane_is_taken_or_its_stream_is_exclusive():
    batcher, _ = make(window_s=0.0)
    full = {f"k{i}": running_lane(f"k{i}") for i in range(MAX_LANES)}
    waiting, behind = queue_up(batcher, [stream_job("other", 1), stream_job("k0", 1)])
    full["k0"].held = JOIN_WAIT_STEPS
    assert batcher._admissions(full) == ([], {key: [] for key in full})
    assert list(batcher._queue) == [waiting, behind]

    class Exclusive(CountdownStream):
        exclusive = True

    lanes = {"k0": running_lane("k0", stream=Exclusive)}
    assert batcher._admissions(lanes) == ([], {"k0": []})
    assert batcher._admissions({"k1": running_lane("k1")}) == ([waiting], {"k1": []})


def test_the_rate_keeps_a_minute_of_counts_however_many_steps_run():
    from transduce.serve import metrics as metrics_module

    metrics = Metrics()
    for _ in range(1000):
        metrics.step_done(32, 0, 0.01)           # steps that finish nothing add nothing
    metrics.step_done(32, 3, 0.01)
    assert len(metrics._recent) == 1
    assert metrics.sentences_per_second() == pytest.approx(3 / metrics_module.RATE_WINDOW_S)
    metrics._recent[0] = (time.monotonic() - 2 * metrics_module.RATE_WINDOW_S, 3)
    metrics.step_done(32, 1, 0.01)               # the old count is dropped as steps go on
    assert [n for _, n in metrics._recent] == [1]


class BlockingStream(CountdownStream):
    """A CountdownStream whose steps record the thread and its intra-op thread count,
    and wait until `release` is set (so two streams are seen running at once)."""

    release = threading.Event()
    seen: list[tuple[str, int]] = []

    def step(self):
        import torch

        BlockingStream.seen.append((threading.current_thread().name, torch.get_num_threads()))
        BlockingStream.release.wait(5)
        return super().step()


def test_two_decoders_run_two_streams_side_by_side_each_with_its_share():
    """32 one-sentence jobs split 16 / 16 between the decoders, which step at the same
    time on one intra-op thread each; the main thread's count is left alone."""
    import torch

    CountdownStream.instances.clear()
    BlockingStream.seen.clear()
    BlockingStream.release.clear()
    threads_before = torch.get_num_threads()
    batcher, _ = make(window_s=0.05, batch_tokens=1000, decoders=2, cores=2)
    futures = [batcher.submit(stream_job("k", 10, stream=BlockingStream)) for _ in range(32)]
    batcher.start()
    try:
        deadline = time.monotonic() + 5
        while len({name for name, _ in BlockingStream.seen}) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        BlockingStream.release.set()
        assert [f.result(5) for f in futures] == ["streamed 10"] * 32
    finally:
        batcher.close(5)
    assert {name for name, _ in BlockingStream.seen} == {"transduce-decoder-0",
                                                         "transduce-decoder-1"}
    assert sorted(len(s.left) + len(s.steps[0]) for s in CountdownStream.instances) == [16, 16]
    # The second to take work did while the first worked: its first step had one thread.
    # (Which decoder that is, is the scheduler's; the first may step alone on both
    # threads before it, and either runs on both again once the other is done.)
    first_steps: dict[str, int] = {}
    for name, count in BlockingStream.seen:
        first_steps.setdefault(name, count)
    assert 1 in first_steps.values()
    assert {count for _, count in BlockingStream.seen} <= {1, 2}
    assert torch.get_num_threads() == threads_before


def test_light_load_stays_on_the_first_decoder_with_every_core():
    """Below SPLIT_AT running sentences the second decoder never starts, and the first
    decodes with all the cores."""
    CountdownStream.instances.clear()
    BlockingStream.seen.clear()
    BlockingStream.release.set()
    batcher, _ = make(window_s=0.0, decoders=2, cores=2)
    batcher.start()
    try:
        for i in range(5):
            jobs = [batcher.submit(stream_job("k", 2 + i, stream=BlockingStream))
                    for _ in range(SPLIT_AT - 1)]
            assert [f.result(5) for f in jobs] == [f"streamed {2 + i}"] * (SPLIT_AT - 1)
    finally:
        batcher.close(5)
    assert {name for name, _ in BlockingStream.seen} == {"transduce-decoder-0"}
    assert {count for _, count in BlockingStream.seen} == {2}


class TimedStream(CountdownStream):
    """A CountdownStream whose steps record (start, end, thread, "step") in `spans`."""

    spans: list[tuple] = []

    def step(self):
        start = time.monotonic()
        done = super().step()
        TimedStream.spans.append((start, time.monotonic(), threading.current_thread().name,
                                  "step"))
        return done


def run_alone(jobs):
    """A batch runner of 50 ms that records (start, end, thread) in TimedStream.spans."""
    start = time.monotonic()
    time.sleep(0.05)
    TimedStream.spans.append((start, time.monotonic(), threading.current_thread().name))
    return ["alone" for _ in jobs]


def test_a_job_that_is_not_streamed_runs_between_steps_while_streams_run():
    """Attention maps and whole batches that arrive while streams run on one decoder
    are run by it between two of its steps (its lanes wait: no step overlaps the run),
    not after every stream has drained; the jobs queued after it do not wait for the
    drain either."""
    CountdownStream.instances.clear()
    TimedStream.spans.clear()
    finished: dict[str, float] = {}

    def timed(future, name):
        future.add_done_callback(lambda _: finished.setdefault(name, time.monotonic()))
        return future

    batcher, _ = make(window_s=0.0, decoders=1, cores=2, batch_tokens=1000)
    batcher.start()
    try:
        streamed = [timed(batcher.submit(stream_job("k", 40, stream=TimedStream)), f"s{i}")
                    for i in range(2 * SPLIT_AT)]
        time.sleep(0.03)
        single = batcher.submit(Job("attention", run_alone, "x", 10, 1))
        later = [timed(batcher.submit(stream_job("k", 5, stream=TimedStream)), f"l{i}")
                 for i in range(4)]
        assert single.result(5) == "alone"
        assert [f.result(5) for f in streamed + later] == \
            ["streamed 40"] * (2 * SPLIT_AT) + ["streamed 5"] * 4
    finally:
        batcher.close(5)
    (run_start, run_end, runner), = [span for span in TimedStream.spans if len(span) == 3]
    steps = [span for span in TimedStream.spans if len(span) == 4]
    assert runner.startswith("transduce-decoder-")
    assert all(end <= run_start or start >= run_end for start, end, _, _ in steps)
    assert any(start >= run_end for start, _, name, _ in steps if name == runner)
    first_done = min(finished[f"s{i}"] for i in range(2 * SPLIT_AT))
    assert run_end < first_done                      # it did not wait for the drain
    assert max(finished[f"l{i}"] for i in range(4)) < first_done        # nor did they


def test_a_job_that_is_not_streamed_never_runs_beside_another_decoder():
    """While two decoders run streams, a job that is not streamed waits until one of
    them is done: no step of either overlaps its run (they share the model, whose
    modules recording attention maps changes)."""
    CountdownStream.instances.clear()
    TimedStream.spans.clear()
    batcher, _ = make(window_s=0.0, decoders=2, cores=2)
    batcher.start()
    try:
        streamed = [batcher.submit(stream_job("k", 20, stream=TimedStream))
                    for _ in range(2 * SPLIT_AT)]
        time.sleep(0.02)
        single = batcher.submit(Job("attention", run_alone, "x", 10, 1))
        later = [batcher.submit(stream_job("k", 5, stream=TimedStream)) for _ in range(4)]
        assert single.result(5) == "alone"
        assert [f.result(5) for f in streamed + later] == \
            ["streamed 20"] * (2 * SPLIT_AT) + ["streamed 5"] * 4
    finally:
        batcher.close(5)
    (run_start, run_end, _), = [span for span in TimedStream.spans if len(span) == 3]
    steps = [span for span in TimedStream.spans if len(span) == 4]
    assert len({name for _, _, name, _ in steps}) == 2        # both decoders streamed
    assert all(end <= run_start or start >= run_end for start, end, _, _ in steps)
    assert any(start >= run_end for start, _, _, _ in steps)   # the later jobs ran after it
