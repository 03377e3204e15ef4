"""The endpoints that say what this server is: models, health, version (as the OpenAI API and vLLM have them).

    GET  /v1/models, /v1/models/{model}   every served model, ``auto`` when a cascade is configured, and
                                           the LoRA adapters (OpenAI's Model object; an adapter's
                                           ``parent`` is the base model, as vLLM lists them; 404 for another)
    GET  /health, GET|POST /ping           200 (empty body) while Redis answers and a decode worker
                                           is ready, else 503 with an OpenAI error and Retry-After:
                                           what vLLM's /health and /ping answer, and what load
                                           tools (guidellm, aiperf) probe before they start
    GET  /health/live, /health/ready       liveness (always) and readiness with the reason
    GET  /version                          {"version": pdserve's version}
    GET  /openapi.json, /docs              pdserve's own OpenAPI document (openapi_doc.py), Swagger UI
                                           (its script and style come from a CDN, as FastAPI's do)
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse

from services.errors import ModelNotFoundError, NoWorkerError
from services.gateway.http_errors import error_response, retry_headers
from services.gateway.openai_format import server_version
from services.gateway.openapi_doc import openapi_document


def info_router(core) -> APIRouter:
    router = APIRouter()
    started_at = int(time.time())

    async def listed() -> list[dict]:
        return [{"id": m["id"], "object": "model", "created": started_at, "owned_by": "pdserve", **m}
                for m in await core.listed_models()]

    @router.get("/v1/models")
    async def models(request: Request):
        core.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": await listed()}

    @router.get("/v1/models/{model:path}")  # a path: Hugging Face names have a slash (org/name)
    async def model(model: str, request: Request):
        core.authenticate(request.headers.get("authorization"))
        found = next((m for m in await listed() if m["id"] == model), None)
        if found is None:
            raise ModelNotFoundError(f"the model {model[:200]!r} does not exist; this server serves "
                                     f"{', '.join(repr(m['id']) for m in await core.listed_models())}", param="model")
        return found

    async def health() -> Response:
        ok, why, _ = await core.readiness()
        if ok:
            return Response(status_code=200)
        exc = NoWorkerError(f"not ready: {why}")
        exc.retry_after_s = core.config.retry_after_s
        return error_response(exc)

    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/ping", health, methods=["GET", "POST"])

    @router.get("/health/live")
    async def live():
        return {"status": "alive"}

    @router.get("/health/ready")
    async def ready():
        ok, why, workers = await core.readiness()
        if ok:
            return {"status": "ready", "decode_workers": workers}
        return JSONResponse({"status": "not ready", "reason": why}, status_code=503,
                            headers=retry_headers(core.config.retry_after_s))

    @router.get("/version")
    async def version():
        return {"version": server_version()}

    document = openapi_document()

    @router.get("/openapi.json")
    async def openapi():
        return document

    @router.get("/docs")
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pdserve gateway")

    return router
