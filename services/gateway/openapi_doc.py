"""pdserve's own OpenAPI document (``GET /openapi.json``, rendered at ``/docs``): exactly what it honours.

The request bodies of the generating endpoints list the fields spec_fields.py
marks honoured or informational, with the values pdserve accepts; the refused
ones are named in ``x-pdserve-refused`` and the operation's description (each is
a 400 naming it). pdserve's own extensions (vLLM's sampling fields, the resume
endpoint, the headers) are documented too. Response bodies are OpenAI's objects,
sketched here with their required fields; OpenAI's own schemas are the contract
the tests hold pdserve to (tests/openai_spec).
"""

from __future__ import annotations

from services.gateway.openai_format import server_version
from services.gateway.spec_fields import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED, RESPONSE_FIELDS, SpecField

_VLLM_EXTRAS = {
    "top_k": {"type": "integer", "description": "vLLM extension: sample from the k most likely tokens (-1: all)"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "description": "vLLM extension"},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "description": "vLLM extension"},
    "ignore_eos": {"type": "boolean", "description": "vLLM extension: generate past the end-of-sequence token"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer"}, "description": "vLLM extension"},
    "skip_special_tokens": {"type": "boolean", "description": "vLLM extension"},
}
_HEADERS = [
    {"name": "Idempotency-Key", "in": "header", "schema": {"type": "string", "maxLength": 256},
     "description": "a retried POST with the same key attaches to the original request"},
    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"},
     "description": "with an Idempotency-Key retry: resume its stream after this event id"},
    {"name": "x-pdserve-priority", "in": "header", "schema": {"type": "string"},
     "description": "a priority tier, never above the API key's"},
    {"name": "x-pdserve-timeout", "in": "header", "schema": {"type": "number"},
     "description": "seconds the request may take (default --default-timeout)"},
]
_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_ERRORS = {str(code): {"description": why, "content": {"application/json": {"schema": _ERROR}}}
           for code, why in ((400, "invalid request: the error's param names the field"),
                             (401, "no or unknown API key"), (404, "unknown model, request or response"),
                             (413, "body over --max-body-bytes"),
                             (429, "queue full or tenant budget spent (Retry-After)"),
                             (503, "no ready decode worker or Redis unavailable (Retry-After)"))}
_OBJECT = {"type": "object"}


def _body(fields: dict[str, SpecField], required: list[str], extras: dict | None = None) -> dict:
    properties = {name: {**spec.schema, "description": spec.note} if spec.note else dict(spec.schema)
                  for name, spec in fields.items() if spec.status != REFUSED}
    return {"type": "object", "required": required, "properties": {**properties, **(extras or {})},
            "x-pdserve-refused": sorted(n for n, s in fields.items() if s.status == REFUSED)}


def _refused_text(fields: dict[str, SpecField]) -> str:
    names = ", ".join(f"`{n}`" for n in sorted(n for n, s in fields.items() if s.status == REFUSED))
    return f"Refused with a 400 naming the field (unless absent, null or OpenAI's default): {names}."


def _generate(summary: str, fields: dict, required: list[str], ok: dict, stream: dict, extras=None) -> dict:
    return {"post": {
        "summary": summary, "description": _refused_text(fields), "parameters": _HEADERS,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _body(fields, required, extras)}}},
        "responses": {"200": {"description": "the result; with stream: true, server-sent events (each with an "
                                             "id:, resumable with Last-Event-ID)",
                              "headers": {"x-request-id": {"schema": {"type": "string"},
                                                           "description": "where to resume"}},
                              "content": {"application/json": {"schema": ok}, "text/event-stream": {"schema": stream}}},
                      **_ERRORS}}}


def _get(summary: str, schema: dict | None, params: list[str] = (), media: str = "application/json",
         errors: tuple[str, ...] = ()) -> dict:
    op: dict = {"summary": summary,
                "parameters": [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                               for p in params],
                "responses": {"200": {"description": "OK"}, **{code: _ERRORS[code] for code in errors}}}
    if schema is not None:
        op["responses"]["200"]["content"] = {media: {"schema": schema}}
    return {"get": op}


def _named(name: str, required: list[str]) -> dict:
    return {"type": "object", "title": name, "required": required}


def openapi_document() -> dict:
    chat = _named("ChatCompletion", ["id", "object", "created", "model", "choices", "usage"])
    chunk = _named("ChatCompletionChunk", ["id", "object", "created", "model", "choices"])
    completion = _named("Completion", ["id", "object", "created", "model", "choices"])
    response = _named("Response", ["id", "object", "created_at", "status", "model", "output"])
    event = _named("ResponseStreamEvent", ["type", "sequence_number"])
    model = _named("Model", ["id", "object", "created", "owned_by"])
    health = _get("200 with an empty body while Redis answers and a decode worker is ready (vLLM's /health)",
                  None, errors=("503",))
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve gateway", "version": server_version(),
                 "description": "OpenAI-compatible API of pdserve. docs/openai-api.md lists every OpenAI request "
                                "field of these endpoints and what pdserve does with it."},
        "paths": {
            "/v1/chat/completions": _generate("Create a chat completion", CHAT_FIELDS, ["messages"], chat, chunk,
                                              _VLLM_EXTRAS),
            "/v1/completions": _generate("Create a completion", COMPLETION_FIELDS, ["prompt"], completion,
                                         completion, _VLLM_EXTRAS),
            "/v1/responses": _generate("Create a response (the Responses API)", RESPONSE_FIELDS, ["input"], response,
                                       event),
            "/v1/responses/{response_id}": _get("A stored response", response, ["response_id"], errors=("404",)),
            "/v1/models": _get("The served model", {"type": "object", "required": ["object", "data"]}),
            "/v1/models/{model}": _get("The served model by name", model, ["model"], errors=("404",)),
            "/v1/requests/{request_id}/events": _get(
                "Resume a chat or completion stream after Last-Event-ID (header or ?last_event_id=)", chunk,
                ["request_id"], "text/event-stream", ("400", "404")),
            "/tokenize": {"post": {"summary": "Token ids of a prompt or of chat messages (the chat template)",
                                   "requestBody": {"required": True, "content": {"application/json": {"schema": {
                                       "type": "object", "properties": {"prompt": {}, "messages": {}, "model": {}}}}}},
                                   "responses": {"200": {"description": "tokens, count, max_model_len"},
                                                 "400": _ERRORS["400"]}}},
            "/health": health,
            "/ping": {"get": health["get"], "post": {**health["get"], "operationId": "ping_post"}},
            "/health/live": _get("Liveness: the process answers", _OBJECT),
            "/health/ready": _get("Readiness with the reason when not ready", _OBJECT, errors=("503",)),
            "/version": _get("pdserve's version", {"type": "object", "required": ["version"]}),
            "/metrics": _get("Prometheus metrics (pdserve_*)", {"type": "string"}, media="text/plain"),
        },
        "components": {"schemas": {"ErrorResponse": {
            "type": "object", "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                                     "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                    "param": {"type": ["string", "null"]},
                                                    "code": {"type": ["string", "null"]}}}}}}},
    }
