"""The Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``, on the chat completions path.

A Responses request becomes the same ``GenerationRequest`` a chat request does
(messages through the chat template, sampling parameters) and goes through the
same admission, queue and result stream (http_admission.admit, core.submit,
responses.sse_events / json_response); only the formatting differs
(responses_format.py). The messages are::

    [system: instructions]  +  the previous response's conversation  +  this input

``previous_response_id`` names a stored response of the same tenant (404 when
there is none: expired, ``store: false``, or never made); its instructions are
not carried over, as OpenAI documents. ``store`` (default true) keeps the
response in Redis (response_store.py) for ``--response-ttl`` seconds.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.errors import InvalidRequestError, NotFoundError
from services.gateway.api_keys import Tenant
from services.gateway.core import GatewayCore
from services.gateway import responses_tools, sse, tools
from services.gateway.http_admission import admit
from services.gateway.protocol import GenerationRequest, get_typed, validate_sampling
from services.gateway.response_store import ResponseStore
from services.gateway.responses import DirectSlot, json_response, sse_events, sse_stream
from services.gateway.responses_format import RESPONSE, ResponseAggregate, ResponseContext, ResponseEvents
from services.gateway.spec_fields import RESPONSE_FIELDS, refuse_unsupported
from services.session_key import validate_session_key

API = "responses"
_INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or an array of text parts",
                                  param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise InvalidRequestError(f"{at}: only text parts are supported (got type {json.dumps(kind)[:40]})",
                                      param=at)
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{at}.text must be a string", param=f"{at}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_input(value: Any) -> list[dict[str, str]]:
    """``input``: a string (one user message) or message items with text content."""
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("input must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input must be a string or a non-empty array of messages", param="input")
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be a message object", param=where)
        kind = item.get("type", "message")
        role = item.get("role")
        if kind != "message":
            call = responses_tools.input_item(item, where)
            if call is None:
                raise InvalidRequestError(f"{where}: only message, function_call and function_call_output "
                                          f"items are supported (got type {json.dumps(kind)[:40]})", param=where)
            messages.append(call)
            continue
        if not isinstance(role, str) or role not in _INPUT_ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {sorted(_INPUT_ROLES)}, got "
                                      f"{json.dumps(role)[:40]}", param=f"{where}.role")
        messages.append({"role": _INPUT_ROLES[role], "content": _text_content(item.get("content"), where)})
    return messages


LOGPROBS = "message.output_text.logprobs"


def _logprobs(body: dict) -> int | None:
    """Alternatives per token when logprobs are asked for (``include`` or ``top_logprobs``), else None."""
    include = get_typed(body, "include", (list,), [])
    bad = next((x for x in include if x != LOGPROBS), None)
    if bad is not None:
        raise InvalidRequestError(f"include: only {LOGPROBS!r} is supported, got {json.dumps(bad)[:60]}",
                                  param="include")
    top = get_typed(body, "top_logprobs", (int,))
    if top is not None and not 0 <= top <= 20:
        raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
    return (top or 0) if include or top is not None else None


class ResponsesRequest:
    """A validated ``POST /v1/responses`` body (before the previous response is read)."""

    def __init__(self, body: dict):
        refuse_unsupported(body, RESPONSE_FIELDS)
        if "input" not in body:
            raise InvalidRequestError("input is required", param="input")
        self.input = parse_input(body["input"])
        self.instructions = get_typed(body, "instructions", (str,))
        self.previous_response_id = get_typed(body, "previous_response_id", (str,))
        self.store = get_typed(body, "store", (bool,), True)
        self.metadata = self._metadata(get_typed(body, "metadata", (dict,), {}))
        self.user = get_typed(body, "user", (str,))
        self.session_key = validate_session_key(body.get("prompt_cache_key"), "prompt_cache_key")
        self.tools, self.tool_choice = responses_tools.parse_tools(body)
        structured = responses_tools.parse_text_format(body)
        forced = tools.structured_output(self.tools, self.tool_choice)
        if structured is not None and forced is not None:
            raise InvalidRequestError("text.format cannot be combined with tool_choice required or a named "
                                      "function (both constrain the output)", param="text.format")
        structured = structured or forced
        self.prompt_tools = self.tools if body.get("tool_choice") != "none" else []
        self.echo = responses_tools.echo(body)
        options = get_typed(body, "stream_options", (dict,), {})
        if get_typed(options, "include_obfuscation", (bool,), False):
            raise InvalidRequestError("stream_options.include_obfuscation: pdserve never pads its events",
                                      param="stream_options.include_obfuscation")
        self.stream = get_typed(body, "stream", (bool,), False)
        self.model = get_typed(body, "model", (str,))
        self.sampling: dict[str, Any] = {"max_tokens": get_typed(body, "max_output_tokens", (int,))}
        if self.sampling["max_tokens"] is not None and self.sampling["max_tokens"] < 1:
            raise InvalidRequestError("max_output_tokens must be an integer >= 1", param="max_output_tokens")
        for name in ("temperature", "top_p"):
            if (value := get_typed(body, name, (float,))) is not None:
                self.sampling[name] = value
        if structured is not None:
            self.sampling["structured"] = {"kind": structured.kind, "spec": structured.spec}
        self.logprobs = _logprobs(body)
        if self.logprobs is not None:
            self.sampling["logprobs"] = self.logprobs
        validate_sampling(self.sampling)

    @staticmethod
    def _metadata(value: dict) -> dict:
        if len(value) > 16 or any(not isinstance(v, str) or len(k) > 64 or len(v) > 512 for k, v in value.items()):
            raise InvalidRequestError("metadata must be at most 16 string pairs (keys up to 64 characters, "
                                      "values up to 512)", param="metadata")
        return value

    def generation(self, earlier: list[dict]) -> GenerationRequest:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return GenerationRequest(RESPONSE, self.model, dict(self.sampling), stream=self.stream,
                                 messages=system + earlier + self.input, user=self.user, session_key=self.session_key,
                                 structured_param="text.format", tools=self.prompt_tools, tool_choice=self.tool_choice,
                                 logprobs=self.logprobs)


def responses_router(core: GatewayCore, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(request: Request):
        parsed: list[tuple[ResponsesRequest, list[dict]]] = []

        async def parse(body: dict, tenant: Tenant) -> GenerationRequest:
            r = ResponsesRequest(body)
            earlier: list[dict] = []
            if r.previous_response_id is not None:
                previous = await store.load(tenant.name, r.previous_response_id)
                if previous is None:
                    raise NotFoundError(f"no response {r.previous_response_id[:128]!r} (it expired, was not "
                                        "stored, or was never made)", param="previous_response_id")
                earlier = previous.conversation
            parsed.append((r, earlier))
            return r.generation(earlier)

        a = await admit(core, request, API, parse)
        r, earlier = parsed[0]
        record = a.admission.record
        ctx = ResponseContext(record, r.instructions, r.previous_response_id, r.store, r.metadata,
                              r.sampling.get("temperature", 1.0), r.sampling.get("top_p", 1.0),
                              r.sampling["max_tokens"], r.user, r.echo)
        conversation = earlier + r.input

        async def keep(builder) -> None:
            if r.store:
                turn = [{"role": "assistant", "content": builder.turn_text()}] if builder.text else []
                await store.save(a.tenant.name, builder.response, conversation + turn)

        fresh = not a.admission.attached  # a retry (Idempotency-Key) must not overwrite what is stored
        if r.stream:
            events = ResponseEvents(ctx)
            if fresh:
                await keep(events)  # fetchable while it runs
            slot = DirectSlot()
            return sse_stream(_stored_after(core, sse_events(core, record, sse.resume_point(sse.START), events, API,
                                                             a.measure, admitted=a.admitted, slot=slot),
                                            events, keep),
                              a.headers, slot)
        aggregate = ResponseAggregate(ctx)
        if fresh:
            await keep(aggregate)
        answer = await json_response(core, request, record, API, a.headers, a.started, aggregate,
                                     admitted=a.admitted if a.measure is not None else None)
        if answer.status_code == 499:  # the client left: its request is cancelled
            aggregate.snapshot("cancelled")
        elif answer.status_code >= 400:
            aggregate.fail(json.loads(answer.body))
        await keep(aggregate)
        return answer

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        tenant = core.authenticate(request.headers.get("authorization"))
        stored = await store.load(tenant.name, response_id)
        if stored is None:
            raise NotFoundError(f"no response {response_id[:128]!r} (it expired, was not stored, or was never "
                                "made)", param="response_id")
        return JSONResponse(stored.response)

    return router


async def _stored_after(core: GatewayCore, body, builder: ResponseEvents, keep):
    """The stream, with the response kept as it ended before the event that ends it is sent (a client that
    retrieves it right after the stream sees the final state); when the stream stops early, kept on its own
    task (a client gone mid-stream cancels this generator, and its request is cancelled too)."""
    kept = False
    try:
        async for chunk in body:
            if not kept and builder.response["status"] != "in_progress":
                await keep(builder)
                kept = True
            yield chunk
    finally:
        if not kept:
            if builder.response["status"] == "in_progress":
                builder.snapshot("cancelled")
            core.spawn(keep(builder))
