"""Errors -> OpenAI error objects with the right HTTP status, and the handlers that make sure of it.

Body: ``{"error": {"message", "type", "param", "code"}}``; ``type`` is the
error's ``code`` (services.errors), ``code`` a finer OpenAI code where there is
one (``invalid_api_key``, ``context_length_exceeded``, ...). Overload answers
carry ``Retry-After`` (whole seconds, and ``retry-after-ms``, which the openai
client prefers); rate-limit answers also carry the ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.errors import InvalidRequestError, PdserveError, ServiceUnavailableError

log = logging.getLogger(__name__)
UNAVAILABLE_RETRY_AFTER_S = 1.0  # what a 503 for Redis trouble tells the client to wait


def openai_error(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def retry_headers(retry_after_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(retry_after_s))), "retry-after-ms": str(int(retry_after_s * 1000))}


def as_pdserve(exc: BaseException) -> BaseException:
    """Redis trouble (down, restarting, or every pooled connection busy past the pool timeout) is the
    queue being unavailable: 503 with Retry-After, the client's to retry, not an internal error."""
    if isinstance(exc, RedisError):
        unavailable = ServiceUnavailableError(f"the queue is unavailable ({type(exc).__name__}: {exc}); "
                                              f"retry after {UNAVAILABLE_RETRY_AFTER_S:g} s")
        unavailable.retry_after_s = UNAVAILABLE_RETRY_AFTER_S
        return unavailable
    return exc


def error_status(exc: BaseException) -> int:
    exc = as_pdserve(exc)
    return exc.http_status if isinstance(exc, PdserveError) else 500


def error_body(exc: BaseException) -> dict:
    exc = as_pdserve(exc)
    if isinstance(exc, PdserveError):
        return openai_error(exc.message, exc.code, exc.param, getattr(exc, "openai_code", None) or exc.code)
    return openai_error("internal server error", "internal_error", None, "internal_error")


def error_headers(exc: BaseException) -> dict[str, str]:
    headers = dict(getattr(exc, "headers", None) or {})
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers.update(retry_headers(retry))
    return headers


def error_response(exc: BaseException, extra_headers: dict[str, str] | None = None) -> JSONResponse:
    exc = as_pdserve(exc)  # before the headers: a Redis error gets its Retry-After
    if not isinstance(exc, PdserveError):
        log.error("unexpected error", exc_info=exc)
    return JSONResponse(error_body(exc), status_code=error_status(exc),
                        headers={**error_headers(exc), **(extra_headers or {})})


def event_error(data: dict) -> PdserveError:
    """A result stream's ``error`` event as the error it stands for (status from the event)."""
    exc = PdserveError(str(data.get("message") or "the request failed"))
    exc.code = str(data.get("code") or "internal_error")
    status = data.get("status")
    exc.http_status = status if type(status) is int and 400 <= status <= 599 else 500
    return exc


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error object; input problems are 4xx, never 422 or 5xx."""

    @app.exception_handler(PdserveError)
    async def _pdserve(_request: Request, exc: PdserveError):
        return error_response(exc)

    @app.exception_handler(RedisError)
    async def _redis(_request: Request, exc: RedisError):
        # its own handler: Starlette re-raises what reaches the catch-all Exception handler after
        # answering (uvicorn then logs a traceback per request and drops the keep-alive connection)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        message = first.get("msg", "invalid request")
        return error_response(InvalidRequestError(f"{'.'.join(loc) + ': ' if loc else ''}{message}",
                                                  param=".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(openai_error(str(exc.detail), type_, None, None), status_code=exc.status_code,
                            headers=dict(exc.headers or {}))



class ErrorBoundaryMiddleware:
    """An unexpected exception becomes a 500 with an OpenAI error body, and the connection stays usable.

    Starlette's own last-resort handler (``exception_handler(Exception)``) answers and then
    re-raises, and uvicorn closes a connection whose app raised: the client's next request on
    that keep-alive connection met a reset. Here the exception ends with the answer.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the boundary: everything becomes an answer
            if started:  # half a response is out: nothing to say that the client could parse
                log.error("the response failed after it started", exc_info=exc)
                raise
            response = error_response(exc)
            await response(scope, receive, send)
