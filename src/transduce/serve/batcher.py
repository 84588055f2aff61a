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
budget, until the oldest queued job has another key; then it drains and that key goes.

Several decoders (`decoders`) run streams side by side, each on its share of the cores
and its share of the running sentences: a decoding step is many small operators, and two
streams of 16 sentences on one core each decode faster than one of 32 on both (2.05x in
one process, int8, the compiled step, whose operators run outside Python). A job that
is not streamed (attention maps, whole batches, other model kinds) runs alone, with
every core: it waits for the streams to drain, as a job of another key does. A stream
may decode in another process (serve/processes.py): its decoder's thread then forwards.

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

    def _streams(self, job: Job) -> bool:
        """Whether `job` is decoded in a stream (which may run beside other streams)."""
        return self.batching and self.continuous and job.stream is not None

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

    def _joining(self, key: Hashable, room: int, least: int, running: int = 0) -> list[Job]:
        """Queued jobs of `key` at the head of the queue, within `room` tokens and the
        stream's share of the sentences (it runs `running`), taken without waiting if
        they hold `least` sentences or more (else none): none once the oldest queued job
        has another key."""
        with self._ready:
            share = self._share(key) - running
            count = sentences = 0
            for job in self._queue:
                if job.key != key or job.tokens > room or sentences + job.sentences > share:
                    break
                count, sentences, room = count + 1, sentences + job.sentences, room - job.tokens
            if not count or sentences < least:
                return []
            taken = [self._queue.popleft() for _ in range(count)]
            self.metrics.queue_depth = len(self._queue)
        return taken

    def _share(self, key: Hashable) -> int:
        """A stream's fair share of the sentences (the lock held): those running in every
        stream and those queued for `key`, over the decoders."""
        queued = sum(job.sentences for job in self._queue if job.key == key)
        return math.ceil((self._streamed + queued) / len(self._threads))

    def _take(self) -> list[Job]:
        """The oldest job and, with batching, later jobs of its key within the budget (and
        a new stream's share of the sentences)."""
        first = self._queue[0]
        share = self._share(first.key) if self._streams(first) else math.inf
        self._queue.popleft()
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
        """Decode a batch step by step in its key's Stream, settling each job when it is
        done and admitting queued jobs of the key between steps, until none runs."""
        key, running = batch[0].key, set()
        tokens = sentences = held = 0                    # of the running jobs
        last_done = time.monotonic()
        try:
            stream = batch[0].stream(rank)
            while True:
                live = [job for job in batch if job.future.set_running_or_notify_cancel()]
                if live:
                    stream.admit(live)
                    running.update(live)
                    tokens += sum(job.tokens for job in live)
                    added = sum(job.sentences for job in live)
                    sentences += added
                    self._streaming(added)
                if not stream.running:
                    return
                self._use_cores(stream)
                started = time.monotonic()
                done = stream.step()
                seconds = time.monotonic() - started
                finished = 0
                for job, result in done:
                    running.discard(job)
                    tokens, finished = tokens - job.tokens, finished + job.sentences
                    job.future.set_result(result)
                self.metrics.step_done(sentences, finished, seconds)
                sentences -= finished
                self._streaming(-finished)
                if done:     # jobs leave one by one: the time between them, for Retry-After
                    now = time.monotonic()
                    self._note_pace((now - last_done) / len(done))
                    last_done = now
                # Newcomers join in groups (encoded together: 1.3-1.5 ms a sentence against
                # 2.2 alone), unless they have waited JOIN_WAIT_STEPS or nothing runs.
                least = 1 if held >= JOIN_WAIT_STEPS or not stream.running else JOIN_GROUP
                batch = self._joining(key, self.batch_tokens - tokens, least, sentences)
                held = 0 if batch or not self._queue else held + 1
        except BaseException as error:          # noqa: BLE001 - handed to the requests
            for job in running | set(batch):
                if not job.future.done():
                    job.future.set_exception(error)
        finally:
            self._streaming(-sentences)

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
            for job in live:
                job.future.set_exception(error)
            return
        seconds = time.monotonic() - started
        self._note_pace(seconds / len(live))
        self.metrics.batch_done(sum(job.sentences for job in live), seconds)
        for job, result in zip(live, results):
            job.future.set_result(result)
