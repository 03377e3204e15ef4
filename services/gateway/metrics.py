"""The gateway's metrics: requests by API and outcome, TTFT and end-to-end latency as clients see them.

``pdserve_gateway_requests_total{api, outcome}`` tells the refusals apart
(unauthorized, rate_limited, overloaded, unavailable); the shared
``pdserve_requests_total{role="gateway"}`` gets the coarse outcome every role
reports. ``pdserve_gateway_coalesced_requests_total{kind}`` counts the requests
that followed an identical one in flight instead of being queued (coalescing.py).
Queue depth per tier (``pdserve_queue_depth``) is set where the depth
is read (backpressure.py).
"""

from __future__ import annotations

from prometheus_client import Counter

from services import phases, telemetry
from services.errors import CapacityError, NoWorkerError, PdserveError, RequestAbortedError
from services.errors import AuthenticationError, RateLimitError
from services.gateway.http_errors import as_pdserve
from services.errors import ServiceUnavailableError

APIS = ("chat", "completion", "responses", "resume", "grpc")
OUTCOMES = ("ok", "aborted", "error", "invalid", "unauthorized", "rate_limited", "overloaded", "unavailable")
_COARSE = {"ok": "ok", "aborted": "aborted", "error": "error", "invalid": "invalid", "unauthorized": "invalid",
           "rate_limited": "error", "overloaded": "error", "unavailable": "error"}

GATEWAY_REQUESTS = Counter("pdserve_gateway_requests_total", "Gateway generation requests by API and outcome.",
                           ["api", "outcome"])
COALESCED_REQUESTS = Counter("pdserve_gateway_coalesced_requests_total",
                            "Requests served by following an identical request in flight (not computed again), "
                            "by kind (chat|completion|response).", ["kind"])


def outcome_of(exc: BaseException) -> str:
    exc = as_pdserve(exc)
    if isinstance(exc, AuthenticationError):
        return "unauthorized"
    if isinstance(exc, RateLimitError):
        return "rate_limited"
    if isinstance(exc, CapacityError):
        return "overloaded"
    if isinstance(exc, (NoWorkerError, ServiceUnavailableError)):
        return "unavailable"
    if isinstance(exc, RequestAbortedError):
        return "aborted"
    if isinstance(exc, PdserveError) and exc.http_status < 500:
        return "invalid"
    return "error"


def count(api: str, outcome: str) -> None:
    GATEWAY_REQUESTS.labels(api, outcome).inc()
    telemetry.REQUESTS.labels("gateway", _COARSE[outcome]).inc()


def count_coalesced(kind: str) -> None:
    COALESCED_REQUESTS.labels(kind).inc()


def observe_ttft(seconds: float) -> None:
    telemetry.TTFT_SECONDS.labels("gateway").observe(seconds)


def observe_e2e(seconds: float) -> None:
    telemetry.E2E_LATENCY_SECONDS.labels("gateway").observe(seconds)


def observe_phases(started: float, admitted: float, first_at: float | None, finished_at: float,
                   final: dict) -> None:
    """A completed request's phases, which tile its time in the gateway (perf_counter times)::

        arrival --admission--> queued --queue_wait--> a router took it --first_chunk--> first chunk
        sent --streaming--> terminal event sent

    queue_wait is the router's own measure (``timings.queue_ms`` of the final event);
    first_chunk is the rest up to the first chunk: routing, prefill, KV transfer, the
    first decode step and the result hop back through Redis.
    """
    first_at = finished_at if first_at is None else first_at
    queue_s = min(max(0.0, float((final.get("timings") or {}).get("queue_ms", 0.0)) / 1e3), first_at - admitted)
    phases.observe("admission", admitted - started, role="gateway")
    phases.observe("queue_wait", queue_s, role="gateway")
    phases.observe("first_chunk", max(0.0, first_at - admitted - queue_s), role="gateway")
    phases.observe("streaming", finished_at - first_at, role="gateway")
