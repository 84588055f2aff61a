"""A lean HTTP/1.1 client for load on loopback: one keep-alive connection, JSON in and out.

The clients of a load test on one machine share its cores with the server they measure.
httpx's asyncio client took 16% of a core at 32 clients against `transduce serve`
(2-core Zen 4): a sixth of what the server could have decoded with. This one writes
a request and reads a Content-Length response with asyncio's streams and nothing more,
as load generators do (wrk, hey); anything else the server answers is an error here.
"""

from __future__ import annotations

import asyncio
import json


class HttpError(Exception):
    """The connection failed or the server answered what this client does not read."""


class LoopbackConnection:
    """One keep-alive connection to host:port. post() sends JSON and returns (status,
    the decoded JSON body or None when it is not JSON)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: object) -> tuple[int, object]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        self._writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                           b"\r\nContent-Length: %d\r\n\r\n%s"
                           % (path.encode(), self.host.encode(), len(body), body))
        try:
            head = await self._reader.readuntil(b"\r\n\r\n")
            status, length, closing = _parse_head(head)
            data = await self._reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            await self.close()
            raise HttpError(f"{type(error).__name__}: {error}") from None
        if closing:
            await self.close()
        try:
            return status, json.loads(data)
        except ValueError:
            return status, None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except ConnectionError:
                pass
        self._reader = self._writer = None


def _parse_head(head: bytes) -> tuple[int, int, bool]:
    """A response's status line and headers -> (status, Content-Length, whether the
    server closes the connection)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.x status line: {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" not in headers:
        raise HttpError(f"a response without Content-Length (headers: {sorted(headers)})")
    return int(parts[1]), int(headers["content-length"]), \
        headers.get("connection", "").lower() == "close"
