"""What every route needs: the loaded model, its decoding worker, the limits, the
metrics, and submit(), which queues a job and awaits it without blocking the event loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from transduce.errors import TransduceError
from transduce.serve.batcher import Batcher, Closed, Job, QueueFull, Stream
from transduce.serve.limits import ApiError, Limits
from transduce.serve.metrics import Metrics
from transduce.serve.schemas import Timings


@dataclass
class Service:
    model: Any                    # Translator | Generator | SentenceEncoder
    name: str
    limits: Limits
    metrics: Metrics
    batcher: Batcher
    languages: tuple[str, str] | None     # (source, target) of a translation model
    decoder_processes: dict | None = None  # rank -> DecoderProcess (translation streams)

    async def submit(self, key: Hashable, run: Callable[[Sequence[Job]], list[Any]],
                     payload: Any, tokens: int, sentences: int,
                     stream: Callable[[int], Stream] | None = None) -> tuple[Any, Timings]:
        """Queue one request's work and await its result -> (result, timings)."""
        job = self.enqueue(key, run, payload, tokens, sentences, stream)
        return await self.wait(job)

    def enqueue(self, key: Hashable, run: Callable[[Sequence[Job]], list[Any]],
                payload: Any, tokens: int, sentences: int,
                stream: Callable[[int], Stream] | None = None) -> Job:
        """Queue a job (decoded by `run` in a batch, or continuously in a `stream`); a
        full queue is 429 with Retry-After, a closing server 503."""
        job = Job(key, run, payload, tokens, sentences, stream)
        try:
            self.batcher.submit(job)
        except QueueFull as full:
            raise ApiError(429, f"the decoding queue is full ({self.limits.max_queue} "
                                f"requests, max_queue); retry after {full.retry_after} s",
                           headers={"Retry-After": str(full.retry_after)}) from None
        except Closed:
            raise ApiError(503, "the server is shutting down",
                           headers={"Connection": "close"}) from None
        return job

    async def wait(self, job: Job) -> tuple[Any, Timings]:
        """A queued job's result and timings; a TransduceError from the model (input it
        cannot take) is 422."""
        try:
            result, started, decode_s = await asyncio.wrap_future(job.future)
        except TransduceError as error:
            raise ApiError(422, str(error)) from None
        done = time.monotonic()
        return result, Timings(queue_ms=round(1000 * (started - job.queued_at), 3),
                               decode_ms=round(1000 * decode_s, 3),
                               total_ms=round(1000 * (done - job.queued_at), 3))

def split_by_job(jobs: Sequence[Job], results: list) -> list[list]:
    """The results of all the jobs' items, in order -> one list per job (its payload's
    length of them)."""
    out, start = [], 0
    for job in jobs:
        out.append(results[start:start + len(job.payload)])
        start += len(job.payload)
    return out


def timed(run: Callable[[Sequence[Job]], list[Any]]) -> Callable[[Sequence[Job]], list[Any]]:
    """Wrap a batch runner so that each job's result carries (result, start, seconds)."""
    def wrapper(jobs: Sequence[Job]) -> list[Any]:
        started = time.monotonic()
        results = run(jobs)
        seconds = time.monotonic() - started
        return [(result, started, seconds) for result in results]
    wrapper.__qualname__ = getattr(run, "__qualname__", "run")
    return wrapper
