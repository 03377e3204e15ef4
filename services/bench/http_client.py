"""A minimal HTTP/1.1 client on asyncio streams, for load generation at thousands of clients.

A benchmark client that costs more CPU than the server measures itself: httpx
spends about a millisecond of Python per request and per streamed chunk, so ten
thousand clients on the same two cores as the server would mostly measure
httpx. This client does only what a load generator needs: one request per
connection or several on a kept-alive one, a JSON body, a response that is
either ``Content-Length`` or chunked, and server-sent events handed out as they
arrive (each with the time it was read). It is not a general HTTP client: no
redirects, no TLS, no compression.

With ``socket_times`` a connection reads its socket itself (``recvmsg`` when the
loop says it is readable) and each event also carries when its last bytes
reached the socket, stamped by the kernel (socket_time.py): a latency study then
does not count the load generator's own lateness in reading a thousand sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.bench import socket_time


class HTTPError(Exception):
    """The server answered something this client cannot read (or closed the connection early)."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes = b""  # the whole body of a non-streaming response
    events: list[tuple[str | None, str, float]] = field(default_factory=list)  # SSE (id, data, wall time read)


class _StampedSocket:
    """A connected socket read by this process, not by a transport: each read's bytes go into a StreamReader and
    ``stamp`` says when the newest of them reached the socket (the kernel's stamp)."""

    def __init__(self, sock: socket.socket, reader: asyncio.StreamReader):
        self.sock, self.reader = sock, reader
        self.stamp: float | None = None
        self._loop = asyncio.get_running_loop()
        self._watching = True
        self._loop.add_reader(sock.fileno(), self._readable)

    @classmethod
    async def connect(cls, host: str, port: int, limit: int) -> _StampedSocket:
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            socket_time.enable(sock)
        except BaseException:
            sock.close()
            raise
        return cls(sock, asyncio.StreamReader(limit=limit))

    def _readable(self) -> None:
        try:
            data, stamp = socket_time.recv(self.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._unwatch()
            self.reader.set_exception(exc)
            return
        if not data:
            self._unwatch()
            self.reader.feed_eof()
            return
        self.stamp = stamp
        self.reader.feed_data(data)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self.sock.fileno())

    async def send(self, data: bytes) -> None:
        await self._loop.sock_sendall(self.sock, data)

    def close(self) -> None:
        self._unwatch()
        self.sock.close()


class Connection:
    """One TCP connection to ``host:port``; ``request`` may be called again while the server keeps it alive.
    ``socket_times``: events also carry the kernel's stamp of when they reached the socket."""

    def __init__(self, host: str, port: int, socket_times: bool = False):
        self.host, self.port = host, port
        self.socket_times = socket_times
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._stamped: _StampedSocket | None = None

    async def _open(self) -> None:
        if self.socket_times:
            self._stamped = await _StampedSocket.connect(self.host, self.port, limit=1 << 20)
            self._reader = self._stamped.reader
        else:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def _send(self, data: bytes) -> None:
        if self._stamped is not None:
            await self._stamped.send(data)
        else:
            self._writer.write(data)

    async def close(self) -> None:
        if self._stamped is not None:
            self._stamped.close()
            self._stamped = self._reader = None
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
        if self._reader is None:
            await self._open()
        payload = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 f"Connection: {'keep-alive' if keep_alive else 'close'}", f"Content-Length: {len(payload)}"]
        if body is not None:
            lines.append("Content-Type: application/json")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        try:
            await self._send(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
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
        stamped = self._stamped
        events = _EventParser(response.events if on_event is None else None, on_event) if sse else None
        stamp = (lambda: stamped.stamp) if stamped is not None else (lambda: None)
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
                    events.feed(data[:-2], stamp())
                else:
                    body += data[:-2]
        elif "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
            if events is not None:
                events.feed(data, stamp())
            else:
                body += data
        else:  # until the server closes
            data = await reader.read()
            if events is not None:
                events.feed(data, stamp())
            else:
                body += data
        response.body = bytes(body)
        return response


class _EventParser:
    """Splits an SSE byte stream into (id, data) events; comments (heartbeats) are skipped. The callback also gets
    the socket's stamp of the bytes that completed each event (None without ``socket_times``)."""

    def __init__(self, into: list | None, callback):
        self.into, self.callback = into, callback
        self.buffer = b""

    def feed(self, data: bytes, stamp: float | None = None) -> None:
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
                self.callback(*event, stamp)
            else:
                self.into.append(event)
