"""What every generating HTTP route does before it answers: authenticate, parse, admit (one place).

Chat completions, completions and the Responses API differ only in how they parse a
body into a ``GenerationRequest`` and how they format the result; the way in (tier,
deadline, trace context, ``core.submit``) and the headers of the answer are these.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from opentelemetry import trace

from services import hops, telemetry
from services.gateway import metrics, protocol, sse
from services.gateway.api_keys import Tenant
from services.gateway.core import Admission, GatewayCore
from services.gateway.protocol import GenerationRequest
from services.session_key import HEADER, session_key_of

# body, tenant -> the request (async: the Responses API reads the previous response first)
Parser = Callable[[dict, Tenant], Awaitable[GenerationRequest]]


@dataclass
class Admitted:
    req: GenerationRequest
    admission: Admission
    tenant: Tenant
    headers: dict[str, str]  # for the answer: x-request-id, x-pdserve-priority, x-ratelimit-*
    resume_from: str  # a fresh request streams from the start; a retry (Idempotency-Key) may resume
    started: float  # perf_counter at arrival
    measure: float | None  # ``started`` for a fresh request (its TTFT is measured), else None
    admitted: float = 0.0  # perf_counter once queued (the end of the gateway's admission phase)


async def admit(core: GatewayCore, request: Request, api: str, parse: Parser) -> Admitted:
    started = time.perf_counter()
    arrived_ns = time.time_ns()
    headers = request.headers
    try:
        tenant = core.authenticate(headers.get("authorization"))
        body = protocol.parse_json_body(await request.body())
        req = await parse(body, tenant)
        req.session_key = session_key_of(req.session_key, headers.get(HEADER))
        tier = core.resolve_tier(tenant, headers.get("x-pdserve-priority"))
        deadline = core.resolve_deadline(headers.get("x-pdserve-timeout"))
        last_id = sse.resume_id(headers.get("last-event-id"))
        parent = telemetry.context_from_carrier(dict(headers))
        with telemetry.tracer("pdserve.gateway").start_as_current_span(
                "gateway.generate", context=parent, kind=trace.SpanKind.SERVER,
                attributes={"api": api, "tenant": tenant.name, "tier": tier}) as span:
            traceparent = telemetry.inject_carrier().get("traceparent", "")
            admission = await core.submit(tenant, req, tier=tier, deadline=deadline,
                                          idempotency_key=headers.get("idempotency-key"), traceparent=traceparent)
            span.set_attribute("request_id", admission.request_id)
        hops.mark(admission.request_id, "gw.arrive", t=arrived_ns)
    except Exception as exc:
        metrics.count(api, metrics.outcome_of(exc))
        raise
    out = {"x-request-id": admission.request_id, "x-pdserve-priority": admission.tier,
           **(admission.rate.headers() if admission.rate else {})}
    attached = admission.attached
    return Admitted(req, admission, tenant, out, last_id if attached else sse.START, started,
                    None if attached else started, time.perf_counter())
