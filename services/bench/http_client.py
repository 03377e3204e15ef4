"""A minimal HTTP/1.1 client on asyncio streams, for load generation at thousands of clients.

A benchmark client that costs more CPU than the server measures itself: httpx
spends about a millisecond of Python per request and per streamed chunk, so ten
thousand clients on the same two cores as the server would mostly measure
httpx. This client does only what a load generator needs: one request per
connection or several on a kept-alive one, a JSON body, a response that is
either ``Content-Length`` or chunked, and server-sent events handed out as they
arrive (each with the time it was read). It is not a general HTTP client: no
redirects, no TLS, no compression.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class HTTPError(Exception):
    """The server answered something this client cannot read (or closed the connection early)."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes = b""  # the whole body of a non-streaming response
    events: list[tuple[str | None, str, float]] = field(default_factory=list)  # SSE (id, data, wall time read)


class Connection:
    """One TCP connection to ``host:port``; ``request`` may be called again while the server keeps it alive."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (OSError, asyncio.CancelledError):
                pass
            self._writer = self._reader = None

    async def request(self, method: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None,
                      on_event: Callable[[str | None, str, float], None] | None = None,
                      on_headers: Callable[[int, dict[str, str]], None] | None = None,
                      keep_alive: bool = False) -> Response:
        """Send one request; a ``text/event-stream`` answer's events go to ``on_event`` as they are read."""
        if self._writer is None:
            await self._open()
        payload = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 f"Connection: {'keep-alive' if keep_alive else 'close'}", f"Content-Length: {len(payload)}"]
        if body is not None:
            lines.append("Content-Type: application/json")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        try:
            response = await self._read_response(on_event, on_headers)
        except BaseException:
            await self.close()
            raise
        if not keep_alive or response.headers.get("connection", "").lower() == "close":
            await self.close()
        return response

    async def _read_response(self, on_event, on_headers) -> Response:
        reader = self._reader
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise HTTPError("the server closed the connection before answering") from exc
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP status line: {status_line[:80]!r}")
        headers = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        response = Response(int(parts[1]), headers)
        if on_headers is not None:
            on_headers(response.status, headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")
        events = _EventParser(response.events if on_event is None else None, on_event) if sse else None
        body = bytearray()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # the empty trailer
                    break
                data = await reader.readexactly(size + 2)
                if events is not None:
                    events.feed(data[:-2])
                else:
                    body += data[:-2]
        elif "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
            if events is not None:
                events.feed(data)
            else:
                body += data
        else:  # until the server closes
            data = await reader.read()
            if events is not None:
                events.feed(data)
            else:
                body += data
        response.body = bytes(body)
        return response


class _EventParser:
    """Splits an SSE byte stream into (id, data) events; comments (heartbeats) are skipped."""

    def __init__(self, into: list | None, callback):
        self.into, self.callback = into, callback
        self.buffer = b""

    def feed(self, data: bytes) -> None:
        now = time.time()
        self.buffer += data
        while True:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                return
            raw, self.buffer = self.buffer[:end], self.buffer[end + 2:]
            event_id, lines = None, []
            for line in raw.decode("utf-8", errors="replace").split("\n"):
                name, _, value = line.partition(":")
                if name == "id":
                    event_id = value.strip()
                elif name == "data":
                    lines.append(value[1:] if value.startswith(" ") else value)
            if not lines:
                continue
            event = (event_id, "\n".join(lines), now)
            if self.callback is not None:
                self.callback(*event)
            else:
                self.into.append(event)
