"""The server's counters, in Prometheus's text exposition format (version 0.0.4).

Written by hand: a few counters, two histograms and three gauges need no client library.
Requests are counted by route template (never by raw path, so a scan of random URLs adds
no series) and status; latency is measured until the response's last byte.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict, deque

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RATE_WINDOW_S = 60.0


class Histogram:
    """Cumulative-bucket histogram with a sum and a count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        suffix = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{suffix} {self.sum:.6f}", f"{name}_count{suffix} {self.count}"]
        return out


class Metrics:
    """What /metrics shows; safe to update from the event loop and the worker thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = {}
        self.batch_sentences = Histogram(BATCH_BUCKETS)
        self.sentences_total = 0
        self.batches_total = 0
        self.decode_seconds = 0.0
        self.queue_depth = 0
        self.in_flight = 0            # decoding requests between arrival and answer
        self._recent: deque[tuple[float, int]] = deque()    # (time, sentences) per batch

    def request_done(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def batch_done(self, sentences: int, seconds: float) -> None:
        """A whole batch of `sentences` decoded in `seconds`."""
        self._decoded(sentences, sentences, seconds)

    def step_done(self, running: int, finished: int, seconds: float) -> None:
        """One step of continuous batching: `running` sentences decoded (the batch's size),
        `finished` of them done at it."""
        self._decoded(running, finished, seconds)

    def _decoded(self, batch_size: int, finished: int, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            self.batch_sentences.observe(batch_size)
            self.sentences_total += finished
            self.batches_total += 1
            self.decode_seconds += seconds
            if finished:
                self._recent.append((now, finished))
            self._forget_before(now - RATE_WINDOW_S)   # a minute's worth, however long it runs

    def sentences_per_second(self) -> float:
        """Sentences decoded over the last minute, per second."""
        now = time.monotonic()
        with self._lock:
            self._forget_before(now - RATE_WINDOW_S)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _forget_before(self, moment: float) -> None:
        """Drop the recent counts older than `moment` (the lock held)."""
        while self._recent and self._recent[0][0] < moment:
            self._recent.popleft()

    def render(self) -> str:
        rate = self.sentences_per_second()
        with self._lock:
            lines = ["# HELP transduce_requests_total HTTP requests by route and status.",
                     "# TYPE transduce_requests_total counter"]
            for (route, status), count in sorted(self.requests.items()):
                lines.append(f'transduce_requests_total{{route="{route}",status="{status}"}} '
                             f"{count}")
            lines += ["# HELP transduce_request_duration_seconds Time to the response's "
                      "last byte.", "# TYPE transduce_request_duration_seconds histogram"]
            for route, histogram in sorted(self.latency.items()):
                lines += histogram.lines("transduce_request_duration_seconds",
                                         f'route="{route}"')
            lines += ["# HELP transduce_batch_sentences Sentences per decoded batch (with "
                      "continuous batching, per decoding step).",
                      "# TYPE transduce_batch_sentences histogram",
                      *self.batch_sentences.lines("transduce_batch_sentences"),
                      *_single("transduce_sentences_total", "counter",
                               "Sentences decoded.", self.sentences_total),
                      *_single("transduce_batches_total", "counter",
                               "Batches decoded (continuous batching: decoding steps).",
                               self.batches_total),
                      *_single("transduce_decode_seconds_total", "counter",
                               "Seconds the worker spent decoding.", self.decode_seconds),
                      *_single("transduce_queue_depth", "gauge",
                               "Requests waiting for the decoding worker.", self.queue_depth),
                      *_single("transduce_sentences_per_second", "gauge",
                               "Sentences decoded per second over the last minute.", rate)]
        return "\n".join(lines) + "\n"


def _single(name: str, kind: str, help_text: str, value: float) -> list[str]:
    number = f"{value:.6f}" if isinstance(value, float) else str(value)
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {number}"]
