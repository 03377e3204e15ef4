"""Refuse request bodies over a size limit before anything parses them (413).

Two checks, because a client may lie or not say: a ``Content-Length`` over the
limit is answered at once without reading the body, and the bytes that actually
arrive are counted as the application reads them, so a chunked (or understated)
body fails with ``PayloadTooLargeError`` as soon as it crosses the limit.

Either way the rest of the body is read and dropped before the answer (up to
``DRAIN_MAX_BYTES`` and ``DRAIN_TIMEOUT_S``): a server that answers and closes
while the client is still uploading leaves unread bytes in its socket, the
kernel answers them with a reset, and the reset throws away the 413 the client
had not read yet. Past those caps the connection is closed after the answer.
"""

from __future__ import annotations

import asyncio
import json

from services.errors import InvalidRequestError, PdserveError
from services.errors import PayloadTooLargeError
from services.gateway.http_errors import error_body

DRAIN_MAX_BYTES = 64 << 20
DRAIN_TIMEOUT_S = 30.0


async def _drain(receive, budget: int) -> bool:
    """Read and drop the rest of a request body; False when it did not end within the caps."""
    async def rest() -> bool:
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return False  # the client went away
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
            if seen > budget:
                return False

    try:
        return await asyncio.wait_for(rest(), DRAIN_TIMEOUT_S)
    except asyncio.TimeoutError:
        return False


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"the request body is larger than the limit of {self.max_body_bytes} bytes")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    return await self._refuse(send, InvalidRequestError("bad Content-Length header"))
                if declared > self.max_body_bytes:
                    drained = declared <= DRAIN_MAX_BYTES and await _drain(receive, DRAIN_MAX_BYTES)
                    return await self._refuse(send, self._too_large(), close=not drained)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_MAX_BYTES)
                    raise self._too_large()
            return message

        await self.app(scope, counting_receive, send)

    @staticmethod
    async def _refuse(send, exc: PdserveError, close: bool = True) -> None:
        body = json.dumps(error_body(exc)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
