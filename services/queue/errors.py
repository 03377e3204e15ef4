"""The queue's own errors, beside the shared ones in services.errors.

They subclass ``PdserveError`` so every edge maps them like the rest (HTTP
status, gRPC status, CLI exit code); they belong in services/errors.py and can
move there unchanged.
"""

from __future__ import annotations

from services.errors import PdserveError


class NotFoundError(PdserveError):
    """The named thing (a result stream, a dead letter) does not exist, or expired."""

    code = "not_found"
    http_status = 404
    grpc_status = "NOT_FOUND"


class QueueUnavailableError(PdserveError):
    """Redis cannot be reached; nothing was queued or changed."""

    code = "service_unavailable"
    http_status = 503
    grpc_status = "UNAVAILABLE"
