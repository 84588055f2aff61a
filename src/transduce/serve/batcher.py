"""Dynamic batching: one decoding thread takes queued requests and runs them together.

Requests arrive as Jobs. The worker takes the oldest job, waits up to the collection
window for more, and joins the queued jobs that have the same key (the same search
settings: jobs with different settings never share a batch) until the batch's token
budget is reached; it then runs the batch with the first job's `run` and hands each job
its own results. Other keys stay queued in arrival order, so none starves. One thread
decodes, so the model never runs twice at once and two cores are not oversubscribed.

Jobs that can be decoded continuously (translation with a Transformer: a `stream`
factory) are not run as one batch that lasts as long as its longest sentence: the batch
is a Stream that decodes step by step, hands each job its results as soon as its
sentences are done, and takes queued jobs of its key in between steps, within the token
budget. A job of another key does not wait for it to drain: it opens a stream of its own
on the same decoder (a lane, up to MAX_LANES keys, each within its own token budget), and
the decoder gives each step to the lane that has had the least decoding time, so a
search of minutes slows a short one of other settings instead of holding it for minutes.
Nothing is taken past a job that must wait for a lane (all lanes in use): the lanes then
drain and it goes next.

Several decoders (`decoders`) run streams side by side, each on its share of the cores
and its share of the running sentences: a decoding step is many small operators, and two
streams of 16 sentences on one core each decode faster than one of 32 on both (2.05x in
one process, int8, the compiled step, whose operators run outside Python). A job that
is not streamed (attention maps, whole batches such as beam-search generation) runs
alone, with every core, when no decoder works; while the streams run on a single decoder,
that decoder runs it (with the queued jobs of its key) between two of its steps, its
lanes waiting meanwhile, so that it neither waits for every stream to drain nor holds
back the jobs queued after it. Never beside another decoder: they share the model, whose
modules recording attention maps changes while it runs. A stream may decode in another
process (serve/processes.py): its decoder's thread then forwards.

The queue is bounded: submit() raises QueueFull, which the app answers with 429.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch

from transduce.serve.metrics import Metrics


JOIN_GROUP = 4         # sentences that join a running stream together
JOIN_WAIT_STEPS = 4    # steps a queued job waits for others to join with it, at most
SPLIT_AT = 8           # sentences running per decoder before the next one starts
MAX_LANES = 4          # keys whose streams one decoder decodes by turns


class QueueFull(Exception):
    """The queue holds max_queue jobs already; retry_after is a guess in seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class Closed(Exception):
    """The server is shutting down and takes no new work."""


class Stream(Protocol):
    """A batch that jobs join and leave between decoding steps (continuous batching)."""

    @property
    def running(self) -> int:
        """Jobs admitted whose results have not been handed back."""

    def admit(self, jobs: Sequence["Job"]) -> None:
        """Start decoding these jobs at the next step."""

    def step(self) -> list[tuple["Job", Any]]:
        """One decoding step -> the jobs done at it, each with its result."""

    # A stream may set `exclusive = True`: its decoder then runs no other stream beside it
    # (one decoded by a process that holds one stream at a time).


@dataclass(eq=False)
class _Lane:
    """One key's stream on a decoder: the jobs it runs, their tokens and sentences, the
    steps its queued jobs have waited to join in a group, and the seconds of steps it has
    had (the decoder steps the lane that has had the fewest)."""

    key: Hashable
    stream: Stream
    jobs: set = field(default_factory=set)
    tokens: int = 0
    sentences: int = 0
    held: int = 0
    used: float = 0.0


@dataclass(eq=False)
class Job:
    """One request's work. key: jobs with equal keys may share a batch; run(jobs) ->
    one result per job (called on the worker thread); tokens: the job's cost against the
    batch budget; sentences: counted in the metrics. stream: when given, stream(rank) is
    a new Stream for jobs of this key on decoder `rank`, which it uses instead of run."""

    key: Hashable
    run: Callable[[Sequence["Job"]], list[Any]]
    payload: Any
    tokens: int
    sentences: int
    stream: Callable[[int], Stream] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    queued_at: float = field(default_factory=time.monotonic)


class Batcher:
    """The queue and its decoding threads. batching=False runs one job at a time;
    continuous=False runs whole batches even for jobs that have a stream."""

    def __init__(self, metrics: Metrics, *, batch_tokens: int, window_s: float,
                 max_queue: int, batching: bool = True, continuous: bool = True,
                 others_coming: Callable[[], bool] = lambda: True, decoders: int = 1,
                 cores: int | None = None):
        """others_coming() tells whether requests not yet queued are in the server: with
        none, the oldest job is decoded at once instead of waiting for the window (one
        client alone then pays no window). decoders: threads that decode (see the module
        note). cores: the intra-op threads they share, each decoder setting its own count
        before every step (all of them while it works alone, an equal share while others
        work too); None leaves PyTorch's count as it is."""
        if decoders < 1 or (cores is not None and cores < 1):
            raise ValueError(f"decoders={decoders}, cores={cores}: both must be at least 1")
        self.metrics, self.batch_tokens, self.window_s = metrics, batch_tokens, window_s
        self.others_coming, self.cores = others_coming, cores
        self.max_queue, self.batching, self.continuous = max_queue, batching, continuous
        self._queue: deque[Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._seconds_per_job = 0.05          # running estimate for Retry-After
        self._working = 0                     # decoders with a batch or a stream
        self._alone = False                   # one of them runs a job that must run alone
        self._streamed = 0                    # sentences running in every stream
        self._threads = [threading.Thread(target=self._loop, args=(rank,), daemon=True,
                                          name=f"transduce-decoder-{rank}")
                         for rank in range(decoders)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> concurrent.futures.Future:
        """Queue a job -> its future; QueueFull when max_queue jobs wait, Closed after
        close()."""
        with self._ready:
            if self._closed:
                raise Closed("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                wait = len(self._queue) * self._seconds_per_job
                raise QueueFull(max(1, int(wait + 0.999)))
            self._queue.append(job)
            self.metrics.queue_depth = len(self._queue)
            self._ready.notify_all()        # the decoder that may start it may not be first
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the worker finish the queued ones, and stop it."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _loop(self, rank: int) -> None:
        while True:
            batch = self._next_batch(rank)
            if batch is None:
                return
            try:
                if self._streams(batch[0]):
                    self._stream(batch, rank)
                else:
                    self._run(batch)
            finally:
                with self._ready:
                    self._working, self._alone = self._working - 1, False
                    self._ready.notify_all()

    @property
    def streams(self) -> bool:
        """Whether jobs that have a stream are decoded in it (not in whole batches)."""
        return self.batching and self.continuous

    def _streams(self, job: Job) -> bool:
        """Whether `job` is decoded in a stream (which may run beside other streams)."""
        return self.streams and job.stream is not None

    def _may_start(self, job: Job, rank: int) -> bool:
        """Whether decoder `rank` may start `job` now (the lock held): a stream beside
        other streams, any other job only when no decoder works. Decoder r starts only
        while the streams run SPLIT_AT * r sentences or more, so light load stays on
        decoder 0 and its intra-op threads (handing one client's requests from decoder to
        decoder, each with its own OpenMP team, ran it at half the speed)."""
        return not self._alone and self._streamed >= SPLIT_AT * rank and \
            (self._working == 0 or self._streams(job))

    def _next_batch(self, rank: int) -> list[Job] | None:
        """Wait for a job decoder `rank` may start, then for the window; take it and the
        queued jobs of its key that fit the token budget. None when closed and empty."""
        with self._ready:
            while True:
                while not (self._queue and self._may_start(self._queue[0], rank)):
                    if self._closed and not self._queue:
                        return None
                    self._ready.wait()
                if self.batching and not self._closed:
                    deadline = self._queue[0].queued_at + self.window_s
                    while self._queue and time.monotonic() < deadline and self._room() > 0 \
                            and not self._closed and self.others_coming():
                        self._ready.wait(min(max(0.0, deadline - time.monotonic()), 0.001))
                if self._queue and self._may_start(self._queue[0], rank):   # still free
                    batch = self._take()
                    self._working += 1
                    self._alone = not self._streams(batch[0])
                    self.metrics.queue_depth = len(self._queue)
                    return batch

    def _room(self) -> int:
        """Tokens the oldest job's key could still add to a batch now."""
        key = self._queue[0].key
        return self.batch_tokens - sum(j.tokens for j in self._queue if j.key == key)

    def _share(self, key: Hashable) -> int:
        """A stream's fair share of the sentences (the lock held): those running in every
        stream and those queued for `key`, over the decoders."""
        queued = sum(job.sentences for job in self._queue if job.key == key)
        return math.ceil((self._streamed + queued) / len(self._threads))

    def _take(self, first: Job | None = None) -> list[Job]:
        """`first` (by default the oldest job) and, with batching, later jobs of its key
        within the budget (and a new stream's share of the sentences), taken from the
        queue (the lock held)."""
        first = first or self._queue[0]
        share = self._share(first.key) if self._streams(first) else math.inf
        self._queue.remove(first)
        batch, tokens = [first], first.tokens
        if not self.batching:
            return batch
        sentences = first.sentences
        for job in list(self._queue):
            if job.key == first.key and tokens + job.tokens <= self.batch_tokens \
                    and sentences + job.sentences <= share:
                self._queue.remove(job)
                batch.append(job)
                tokens, sentences = tokens + job.tokens, sentences + job.sentences
        return batch

    def _use_cores(self, stream: Stream | None = None) -> None:
        """Set this decoder's intra-op threads to its share of `cores` (the count is per
        thread in PyTorch's OpenMP pool), or tell a stream that decodes in another
        process (one with use_cores) to use that many."""
        if self.cores is None:
            return
        share = max(1, self.cores // max(1, self._working))
        if hasattr(stream, "use_cores"):
            stream.use_cores(share)
        elif torch.get_num_threads() != share:
            torch.set_num_threads(share)

    def _note_pace(self, seconds_per_job: float) -> None:
        """Fold a new observation into the running estimate that Retry-After reads."""
        self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * seconds_per_job

    def _stream(self, batch: list[Job], rank: int) -> None:
        """Decode lanes step by step until none runs: the batch's key first, then queued
        jobs taken between steps (_admissions), each step going to the lane that has had
        the least decoding time."""
        lanes: dict[Hashable, _Lane] = {}
        try:
            self._run_lanes(lanes, batch, rank)
        except BaseException as error:          # noqa: BLE001 - no request left waiting
            for lane in list(lanes.values()):
                self._close_lane(lanes, lane, error)

    def _run_lanes(self, lanes: dict[Hashable, "_Lane"], batch: list[Job], rank: int) -> None:
        last_done = time.monotonic()
        self._open(lanes, batch, rank)
        while True:
            for key in [key for key, lane in lanes.items() if not lane.stream.running]:
                del lanes[key]
            if not lanes:
                return
            # The newest of the lanes with the least time first: a new lane steps next.
            done = self._step(lanes, min(reversed(lanes.values()), key=lambda lane: lane.used))
            if done:        # jobs leave one by one: the time between them, for Retry-After
                now = time.monotonic()
                self._note_pace((now - last_done) / done)
                last_done = now
            opening, joining = self._admissions(lanes)
            for key, jobs in joining.items():
                if jobs and key in lanes:
                    self._admit(lanes, lanes[key], jobs)
            if opening and self._streams(opening[0]):
                self._open(lanes, opening, rank)
            elif opening:
                self._run_between_steps(opening)

    def _admissions(self, lanes: dict[Hashable, "_Lane"]
                    ) -> tuple[list[Job], dict[Hashable, list[Job]]]:
        """Queued jobs taken between steps -> (a new lane's batch or [], the jobs that
        join each lane). From the head of the queue, jobs join their key's lane within
        its token room and its share of the sentences, in groups of JOIN_GROUP sentences
        (encoded together: 1.3-1.5 ms a sentence against 2.2 alone) unless they have
        waited JOIN_WAIT_STEPS or the lane runs nothing. The first job that cannot join
        opens a lane if its key may have one (_may_open), or, not streamed, is taken with
        its key's queued jobs to run now if no other decoder works; nothing is taken past
        it."""
        with self._ready:
            joining: dict[Hashable, list[Job]] = {key: [] for key in lanes}
            room = {key: [self.batch_tokens - lane.tokens, self._share(key) - lane.sentences]
                    for key, lane in lanes.items()}
            waiting = None
            for job in self._queue:
                left = room.get(job.key)
                if left is None or job.tokens > left[0] or job.sentences > left[1]:
                    waiting = job
                    break
                joining[job.key].append(job)
                left[0], left[1] = left[0] - job.tokens, left[1] - job.sentences
            for key, jobs in joining.items():
                lane = lanes[key]
                least = 1 if lane.held >= JOIN_WAIT_STEPS or not lane.stream.running \
                    else JOIN_GROUP
                if sum(job.sentences for job in jobs) < least:
                    jobs.clear()
                queued = any(job.key == key for job in self._queue)
                lane.held = 0 if jobs or not queued else lane.held + 1
                for job in jobs:
                    self._queue.remove(job)
            opening = []
            if waiting and self._streams(waiting) and self._may_open(lanes, waiting):
                opening = self._take(waiting)
            elif waiting and not self._streams(waiting) and self._working == 1:
                # No other decoder may start until it is done (_run_between_steps).
                opening, self._alone = self._take(waiting), True
            self.metrics.queue_depth = len(self._queue)
        return opening, joining

    def _run_between_steps(self, batch: list[Job]) -> None:
        """A batch that is not streamed, run by the only decoder working, its lanes
        waiting. No other decoder starts meanwhile: they share the model, whose modules
        recording attention maps changes for the duration."""
        try:
            self._run(batch)
        finally:
            with self._ready:
                self._alone = False
                self._ready.notify_all()

    def _may_open(self, lanes: dict[Hashable, "_Lane"], job: Job) -> bool:
        """Whether `job` may open a lane beside `lanes`: a streamed job of a key none of
        them runs, while fewer than MAX_LANES run and none is exclusive."""
        return self._streams(job) and job.key not in lanes and len(lanes) < MAX_LANES \
            and not any(getattr(lane.stream, "exclusive", False) for lane in lanes.values())

    def _open(self, lanes: dict[Hashable, "_Lane"], batch: list[Job], rank: int) -> None:
        """Start a lane for the batch's key on decoder `rank`, with the least time any
        lane has had (it steps next), and admit the batch."""
        try:
            stream = batch[0].stream(rank)
        except BaseException as error:          # noqa: BLE001 - handed to the requests
            self._fail(batch, error)
            return
        used = min((lane.used for lane in lanes.values()), default=0.0)
        lanes[batch[0].key] = lane = _Lane(batch[0].key, stream, used=used)
        self._admit(lanes, lane, batch)

    def _admit(self, lanes: dict[Hashable, "_Lane"], lane: "_Lane", jobs: list[Job]) -> None:
        """Start decoding the jobs not cancelled in `lane` at its next step."""
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            lane.stream.admit(live)
        except BaseException as error:          # noqa: BLE001 - handed to the requests
            self._close_lane(lanes, lane, error, live)
            return
        lane.jobs.update(live)
        lane.tokens += sum(job.tokens for job in live)
        added = sum(job.sentences for job in live)
        lane.sentences += added
        self._streaming(added)

    def _step(self, lanes: dict[Hashable, "_Lane"], lane: "_Lane") -> int:
        """One step of `lane`'s stream, settling the jobs done at it -> how many."""
        self._use_cores(lane.stream)
        started = time.monotonic()
        try:
            done = lane.stream.step()
        except BaseException as error:          # noqa: BLE001 - handed to the requests
            self._close_lane(lanes, lane, error)
            return 0
        seconds = time.monotonic() - started
        lane.used += seconds
        finished = 0
        for job, result in done:
            lane.jobs.discard(job)
            lane.tokens, finished = lane.tokens - job.tokens, finished + job.sentences
            job.future.set_result(result)
        self.metrics.step_done(lane.sentences, finished, seconds)
        lane.sentences -= finished
        self._streaming(-finished)
        return len(done)

    def _close_lane(self, lanes: dict[Hashable, "_Lane"], lane: "_Lane",
                    error: BaseException, more: Sequence[Job] = ()) -> None:
        """A lane whose stream failed: its jobs (and `more`) get the error, and the lane
        goes; the other lanes go on."""
        self._fail([*lane.jobs, *more], error)
        self._streaming(-lane.sentences)
        del lanes[lane.key]

    @staticmethod
    def _fail(jobs: Sequence[Job], error: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    def _streaming(self, change: int) -> None:
        """Count `change` more sentences running in the streams (more may let another
        decoder start)."""
        with self._ready:
            self._streamed += change
            if change > 0:
                self._ready.notify_all()

    def _run(self, batch: list[Job]) -> None:
        """Run a batch and settle every job's future, with its result or the error."""
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        self._use_cores()
        started = time.monotonic()
        try:
            results = live[0].run(live)
        except BaseException as error:          # noqa: BLE001 - handed to the requests
            self._fail(live, error)
            return
        seconds = time.monotonic() - started
        self._note_pace(seconds / len(live))
        self.metrics.batch_done(sum(job.sentences for job in live), seconds)
        for job, result in zip(live, results):
            job.future.set_result(result)
