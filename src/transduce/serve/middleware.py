"""ASGI middleware: request metrics, and a cap on the body's size read before any route.

Both are plain ASGI (no BaseHTTPMiddleware), so streamed responses pass through as they
are made, and the latency measured ends at the response's last byte.
"""

from __future__ import annotations

import json
import time

from transduce.serve.metrics import Metrics


class MetricsMiddleware:
    """Counts each HTTP request by route template and status, with its latency, and the
    POST requests in flight (the batcher waits for more only while others are coming)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), [500]
        decoding = scope["method"] == "POST"      # the requests that become decoding jobs
        self.metrics.in_flight += decoding

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.in_flight -= decoding
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.request_done(name, status[0], time.monotonic() - started)


class BodyLimitMiddleware:
    """Reads the whole request body first and refuses one over max_bytes with 413
    (Content-Length or chunked alike), so no route ever holds a huge body."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        await self.app(scope, _replay([{"type": "http.request", "body": body,
                                        "more_body": False}], receive), send)

    async def _refuse(self, send):
        payload = json.dumps({"error": f"the body is over the limit of {self.max_bytes} "
                                       f"bytes (max_texts x max_chars, with room for JSON)"}
                             ).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list, receive=None):
    """A receive() that gives these messages, then waits on the real one (for a client
    that disconnects while its request is served)."""
    async def replayed():
        if messages:
            return messages.pop(0)
        if receive is None:
            return {"type": "http.disconnect"}
        return await receive()
    return replayed
