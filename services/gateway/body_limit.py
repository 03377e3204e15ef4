"""Refuse request bodies over a size limit before anything parses them (413).

Two checks, because a client may lie or not say: a ``Content-Length`` over the
limit is answered at once without reading the body, and the bytes that actually
arrive are counted as the application reads them, so a chunked (or understated)
body fails with ``PayloadTooLargeError`` as soon as it crosses the limit.
"""

from __future__ import annotations

import json

from services.errors import InvalidRequestError, PdserveError
from services.errors import PayloadTooLargeError
from services.gateway.http_errors import error_body


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
                    return await self._refuse(send, self._too_large())
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, counting_receive, send)

    @staticmethod
    async def _refuse(send, exc: PdserveError) -> None:
        body = json.dumps(error_body(exc)).encode()
        await send({"type": "http.response.start", "status": exc.http_status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
