"""Running the app with uvicorn, with a shutdown that drains.

On SIGTERM (or SIGINT) the server stops listening, so new connections are refused; the
requests in flight, queued ones included, are answered; then the decoding worker stops
and serve() returns, so the process exits with status 0. uvicorn itself would raise the
signal again once done (and the process would die of it): DrainingServer keeps the
handlers it installs for the run only and puts back the ones it found.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from typing import Any, Callable, Iterator

import uvicorn

from transduce.serve.app import create_app
from transduce.serve.limits import Limits

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signal handlers start a graceful shutdown and nothing more."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        found = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig, handler in found.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for listening in (sockets or []) if self.started else []:    # uvicorn says only its own
            host, port = listening.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            logging.getLogger("uvicorn.error").info(
                "Listening on http://%s:%d (Ctrl+C to stop)", shown, port)
        said = getattr(getattr(self.config.app, "state", None), "summary", None)
        if self.started and said:
            logging.getLogger("uvicorn.error").info("%s", said)

    def _on_signal(self, sig: int, _frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True              # a second Ctrl-C: stop waiting
        self.should_exit = True


def serve(model, *, name: str = "model", host: str = "127.0.0.1", port: int = 8000,
          limits: Limits | None = None, languages: tuple[str, str] | None = None,
          drain_timeout_s: float = 60.0, log_level: str = "info",
          sock: socket.socket | None = None, reload: Callable[[], Any] | None = None) -> None:
    """Serve `model` until SIGTERM or SIGINT, then drain and return. `sock`: an already
    bound socket to serve on instead of host and port; reload: create_app's."""
    app = create_app(model, name=name, limits=limits, languages=languages, reload=reload)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout_s, lifespan="on")
    server = DrainingServer(config)
    server.run(sockets=[sock] if sock is not None else None)
