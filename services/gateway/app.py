"""The HTTP edge: thin FastAPI routes that parse, call the core, and answer (OpenAI-compatible).

    POST /v1/chat/completions, /v1/completions   generate (stream: SSE; else JSON)
    GET  /v1/requests/{id}/events                resume a request's SSE stream after Last-Event-ID
    POST /tokenize                               {"prompt"} or {"messages"} -> token ids
    GET  /metrics
    POST /admin/profile?seconds=S                only with --enable-profiling (profile_route.py)
    models, health, version: info_routes.py; the Responses API: responses_api.py

Request headers: ``Authorization: Bearer <key>``, ``Idempotency-Key``,
``Last-Event-ID``, ``x-pdserve-priority`` (a tier, never above the key's),
``x-pdserve-timeout`` (seconds). Responses to generate carry ``x-request-id``
(where to resume) and, for keys with budgets, ``x-ratelimit-*``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.errors import InvalidRequestError
from services.gateway import choices, prompts, protocol, sse
from services.gateway.body_limit import BodyLimitMiddleware
from services.gateway.core import GatewayCore
from services.gateway.direct_write import RawSendCapture
from services.gateway.http_admission import admit
from services.gateway.http_errors import ErrorBoundaryMiddleware, install_handlers
from services.gateway.http_metrics import HttpMetricsMiddleware
from services.gateway.info_routes import info_router
from services.gateway.protocol import GenerationRequest
from services.gateway.request_record import CHAT, COMPLETION
from services.gateway.response_store import ResponseStore
from services.gateway.responses import json_response, stream_response
from services.gateway.responses_api import responses_router
from services.gateway.responses_format import RESPONSE


def served_app(core: GatewayCore, profiler=None) -> RawSendCapture:
    """What the HTTP server runs: the application, with the server's own send kept for direct chunk writes."""
    return RawSendCapture(create_app(core, profiler))


def create_app(core: GatewayCore, profiler=None) -> FastAPI:
    """``profiler``: a services.profiling Profiler when profiling is enabled (adds POST /admin/profile)."""
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.core = core
    install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=core.config.max_body_bytes)
    app.add_middleware(ErrorBoundaryMiddleware)
    app.add_middleware(HttpMetricsMiddleware)  # added last: outermost, counts the others' answers too
    app.include_router(info_router(core))
    app.include_router(responses_router(core, ResponseStore(core.redis, core.config.response_ttl_s)))
    if core.config.lora_admin:
        from services.gateway.lora_routes import lora_admin_router

        app.include_router(lora_admin_router(core))
    if profiler is not None:
        from services.gateway.profile_route import profile_router

        app.include_router(profile_router(core, profiler))

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
        if record.kind == RESPONSE:
            raise InvalidRequestError(f"request {request_id} is a Responses API request; read it with "
                                      f"GET /v1/responses/resp_{request_id}", param="request_id")
        return stream_response(core, record, last_id, record.include_usage, "resume",
                               {"x-request-id": record.request_id})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        core.authenticate(request.headers.get("authorization"))
        body = protocol.parse_json_body(await request.body())
        served = core.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
        if ("prompt" in body) == ("messages" in body):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        if "messages" in body:
            ids = await prompts.encode(served, messages=protocol.parse_messages(body["messages"]))
        else:
            ids = await prompts.encode(served, prompt=protocol.parse_prompt(body["prompt"]))
        return {"tokens": ids, "count": len(ids), "max_model_len": await core.max_model_len(served)}

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            await core.load.read_now()  # refreshes pdserve_queue_depth
        except Exception:  # Redis away: still expose what this process knows
            pass
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _generate(core: GatewayCore, request: Request, kind: str) -> Response:
    async def parse(body: dict, _tenant) -> GenerationRequest:
        max_n = core.config.max_n
        return protocol.parse_chat(body, max_n) if kind == CHAT else protocol.parse_completion(body, max_n)

    a = await admit(core, request, kind, parse)
    if a.req.candidates > 1:
        records = choices.records_of(a.req, a.admission)
        if a.req.stream:
            return choices.stream_response(core, a, records, kind)
        return await choices.json_response(core, request, a, records, kind)
    if a.req.stream:
        return stream_response(core, a.admission.record, a.resume_from, a.req.include_usage, kind, a.headers,
                               a.measure, a.admitted)
    return await json_response(core, request, a.admission.record, kind, a.headers, a.started,
                               admitted=a.admitted if a.measure is not None else None)
