"""Errors defined once; each edge (CLI, HTTP, gRPC) maps them to its own form.

``code`` is the OpenAI error ``type``; ``http_status`` and ``grpc_status`` are
what the HTTP and gRPC edges answer with.
"""

from __future__ import annotations


def is_described(exc: BaseException) -> bool:
    """Whether ``exc`` says how the edges answer it: a PdserveError, or an error of a layer below
    services that carries the same ``code`` / ``http_status`` / ``grpc_status`` / ``message``
    (``kvtransfer.TransferError``; kvtransfer imports nothing from services)."""
    return isinstance(exc, PdserveError) or all(
        hasattr(exc, name) for name in ("code", "http_status", "grpc_status", "message"))


class PdserveError(Exception):
    code = "internal_error"
    http_status = 500
    grpc_status = "INTERNAL"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(PdserveError, ValueError):
    """The request itself is wrong (bad parameter, empty or over-long prompt)."""

    code = "invalid_request_error"
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"


class ModelNotFoundError(PdserveError):
    code = "model_not_found"
    http_status = 404
    grpc_status = "NOT_FOUND"


class ModelLoadError(PdserveError):
    """A model path exists but cannot be loaded (corrupt or unsupported file)."""

    code = "model_load_error"
    http_status = 500
    grpc_status = "FAILED_PRECONDITION"


class CapacityError(PdserveError):
    """No room right now (no free KV blocks, queue full); retrying later may work."""

    code = "capacity_exceeded"
    http_status = 429
    grpc_status = "RESOURCE_EXHAUSTED"


class RequestAbortedError(PdserveError):
    code = "request_aborted"
    http_status = 499
    grpc_status = "CANCELLED"


class TransferError(PdserveError):
    """Moving KV blocks between processes failed (peer gone, timeout, mismatch): a worker said so
    (UNAVAILABLE), or the hand-off itself failed. Inside a worker, kvtransfer raises its own
    ``kvtransfer.TransferError`` with the same code and statuses."""

    code = "kv_transfer_error"
    http_status = 502
    grpc_status = "UNAVAILABLE"


class ReservationLostError(PdserveError):
    """A worker no longer holds what the router reserved there (expired, freed under it): a race
    between the router and the worker, the server's fault, so the router retries (gRPC ABORTED:
    retry at a higher level)."""

    code = "reservation_lost"
    http_status = 500
    grpc_status = "ABORTED"


class DeadlineExceededError(PdserveError):
    """The request's deadline passed; the work was dropped, not run."""

    code = "deadline_exceeded"
    http_status = 504
    grpc_status = "DEADLINE_EXCEEDED"


class NoWorkerError(PdserveError):
    """No ready worker can take the request now (none registered, all draining or failed)."""

    code = "service_unavailable"
    http_status = 503
    grpc_status = "UNAVAILABLE"


class NotFoundError(PdserveError):
    """The named thing (a request's result stream, a dead letter) does not exist, or expired."""

    code = "not_found"
    http_status = 404
    grpc_status = "NOT_FOUND"


class ServiceUnavailableError(PdserveError):
    """Redis cannot be reached; nothing was queued or changed."""

    code = "service_unavailable"
    http_status = 503
    grpc_status = "UNAVAILABLE"


class AuthenticationError(PdserveError):
    """No API key, or one this gateway does not know."""

    code = "invalid_request_error"
    openai_code = "invalid_api_key"
    http_status = 401
    grpc_status = "UNAUTHENTICATED"


class RateLimitError(CapacityError):
    """The tenant's per-minute request or token budget is spent; ``headers`` say how it stands."""

    code = "rate_limit_exceeded"
    openai_code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float, headers: dict[str, str]):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = headers


class PayloadTooLargeError(InvalidRequestError):
    code = "invalid_request_error"
    openai_code = "request_too_large"
    http_status = 413


class ProfilingDisabledError(PdserveError):
    """Profiling was asked of a process started without --enable-profiling."""

    code = "profiling_disabled"
    http_status = 403
    grpc_status = "FAILED_PRECONDITION"


class ProfilerBusyError(PdserveError):
    """A profile is already being recorded in this process (one at a time)."""

    code = "profiler_busy"
    http_status = 409
    grpc_status = "ABORTED"


class NothingRecordedError(PdserveError):
    """A profile found no request or engine step in its window: the stack was idle."""

    code = "nothing_recorded"
    http_status = 409
    grpc_status = "FAILED_PRECONDITION"
