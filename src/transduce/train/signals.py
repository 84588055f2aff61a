"""SIGINT and SIGTERM ask a training run to save a final checkpoint and stop, for as long
as the run lasts: the handlers that were there before are restored when it ends, so
Ctrl-C interrupts a notebook again after train() returns."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """`received` names the signal once one arrived; None until then."""

    def __init__(self) -> None:
        self.received: str | None = None

    def _handle(self, number, frame) -> None:
        self.received = signal.Signals(number).name


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Catch SIGINT / SIGTERM meanwhile. Signal handlers belong to the main thread; in
    any other thread nothing is installed and `received` stays None."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request._handle) for sig in _SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
