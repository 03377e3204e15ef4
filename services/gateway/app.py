"""The HTTP edge: thin FastAPI routes that parse, call the core, and answer (OpenAI-compatible).

    POST /v1/chat/completions, /v1/completions   generate (stream: SSE; else JSON)
    GET  /v1/requests/{id}/events                resume a request's SSE stream after Last-Event-ID
    GET  /v1/models                              the served model
    POST /tokenize                               {"prompt"} or {"messages"} -> token ids
    GET  /health/live, /health/ready, /metrics

Request headers: ``Authorization: Bearer <key>``, ``Idempotency-Key``,
``Last-Event-ID``, ``x-pdserve-priority`` (a tier, never above the key's),
``x-pdserve-timeout`` (seconds). Responses to generate carry ``x-request-id``
(where to resume) and, for keys with budgets, ``x-ratelimit-*``.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services import telemetry
from services.errors import InvalidRequestError
from services.gateway import metrics, prompts, protocol, sse
from services.gateway.body_limit import BodyLimitMiddleware
from services.gateway.core import GatewayCore
from services.gateway.http_errors import install_handlers, retry_headers
from services.gateway.http_metrics import HttpMetricsMiddleware
from services.gateway.request_record import CHAT, COMPLETION
from services.gateway.responses import json_response, stream_response


def create_app(core: GatewayCore) -> FastAPI:
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.core = core
    install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=core.config.max_body_bytes)
    app.add_middleware(HttpMetricsMiddleware)  # added last: outermost, counts the others' answers too
    started_at = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(core, request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(core, request, COMPLETION)

    @app.get("/v1/requests/{request_id}/events")
    async def request_events(request_id: str, request: Request, last_event_id: str | None = None):
        tenant = core.authenticate(request.headers.get("authorization"))
        last_id = sse.resume_id(request.headers.get("last-event-id"), last_event_id)
        record = await core.find(tenant, request_id)
        return stream_response(core, record, last_id, record.include_usage, "resume",
                               {"x-request-id": record.request_id})

    @app.get("/v1/models")
    async def models(request: Request):
        core.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": core.model.name, "object": "model", "created": started_at,
                                            "owned_by": "pdserve", "max_model_len": await core.max_model_len()}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        core.authenticate(request.headers.get("authorization"))
        body = protocol.parse_json_body(await request.body())
        core.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
        if ("prompt" in body) == ("messages" in body):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        if "messages" in body:
            ids = await prompts.encode(core.model, messages=protocol.parse_messages(body["messages"]))
        else:
            ids = await prompts.encode(core.model, prompt=protocol.parse_prompt(body["prompt"]))
        return {"tokens": ids, "count": len(ids), "max_model_len": await core.max_model_len()}

    @app.get("/health/live")
    async def live():
        return {"status": "alive"}

    @app.get("/health/ready")
    async def ready():
        ok, why, workers = await core.readiness()
        if ok:
            return {"status": "ready", "decode_workers": workers}
        return JSONResponse({"status": "not ready", "reason": why}, status_code=503,
                            headers=retry_headers(core.config.retry_after_s))

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            await core.load.depth()  # refreshes pdserve_queue_depth
        except Exception:  # Redis away: still expose what this process knows
            pass
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _generate(core: GatewayCore, request: Request, kind: str) -> Response:
    started = time.perf_counter()
    api = kind
    headers = request.headers
    try:
        tenant = core.authenticate(headers.get("authorization"))
        body = protocol.parse_json_body(await request.body())
        req = protocol.parse_chat(body) if kind == CHAT else protocol.parse_completion(body)
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
    except Exception as exc:
        metrics.count(api, metrics.outcome_of(exc))
        raise
    out = {"x-request-id": admission.request_id, "x-pdserve-priority": admission.tier,
           **(admission.rate.headers() if admission.rate else {})}
    # a fresh request streams from the start; a retry (Idempotency-Key) may resume after Last-Event-ID
    resume_from = last_id if admission.attached else "0"
    measure = None if admission.attached else started
    if req.stream:
        return stream_response(core, admission.record, resume_from, req.include_usage, api, out, measure)
    return await json_response(core, request, admission.record, api, out, started)
