"""Hold every gateway answer a test receives to OpenAI's published schemas (openapi.json beside this file).

``SpecCheck.install(monkeypatch)`` wraps httpx's transports (the ``openai``
client's too), so each response from an endpoint below is checked as the client
reads it: a JSON body against the operation's 200 schema (an error status
against ``ErrorResponse``), and each SSE ``data:`` event against the operation's
``text/event-stream`` schema (an ``{"error": ...}`` event against
``ErrorResponse``). ``violations`` collects what did not conform; the fixture in
tests/conftest.py fails the test with them.

Two readings of the document, both stated here:

- ``nullable: true`` (OpenAPI 3.0's keyword, still used in places of this 3.1
  document) means "or null"; JSON Schema 2020-12 alone would ignore it.
- ``/completions`` documents no ``text/event-stream`` schema; its stream chunks
  are ``CreateCompletionResponse`` objects whose ``finish_reason`` and ``usage``
  may be null before the last chunk, as OpenAI's own streams send them.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import httpx
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).resolve().parent / "openapi.json"
_ROOT = "urn:openai-openapi"
_COMPLETION_CHUNK = "PdserveCompletionStreamChunk"

# gateway path (after /v1) -> the document's path template; None: pdserve's own (resume: by the chunk's object)
_PATHS = [(re.compile(p), template) for p, template in (
    (r"/v1/chat/completions", "/chat/completions"), (r"/v1/completions", "/completions"), (r"/v1/models", "/models"),
    (r"/v1/models/.+", "/models/{model}"), (r"/v1/responses", "/responses"),
    (r"/v1/responses/[^/]+", "/responses/{response_id}"), (r"/v1/requests/[^/]+/events", None))]
_BY_OBJECT = {"chat.completion.chunk": "/chat/completions", "text_completion": "/completions"}


def _or_null(node):
    if isinstance(node, list):
        return [_or_null(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _or_null(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@cache
def document() -> dict:
    doc = _or_null(json.loads(SPEC_PATH.read_text()))
    chunk = copy.deepcopy(doc["components"]["schemas"]["CreateCompletionResponse"])
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    chunk["properties"]["usage"] = {"anyOf": [chunk["properties"]["usage"], {"type": "null"}]}
    doc["components"]["schemas"][_COMPLETION_CHUNK] = chunk
    return doc


@cache
def _registry() -> Registry:
    return Registry().with_resource(_ROOT, Resource.from_contents(document(), default_specification=DRAFT202012))


@cache
def validator(ref: str) -> Draft202012Validator:
    """A validator of ``#/components/...`` (a ref as the document writes it)."""
    return Draft202012Validator({"$ref": f"{_ROOT}{ref}"}, registry=_registry())


def _schema_ref(template: str, method: str, status: int, stream: bool) -> str:
    if status >= 400:
        return "#/components/schemas/ErrorResponse"
    if template == "/completions" and stream:
        return f"#/components/schemas/{_COMPLETION_CHUNK}"
    content = document()["paths"][template][method]["responses"]["200"]["content"]
    return content["text/event-stream" if stream else "application/json"]["schema"]["$ref"]


def errors_of(instance, ref: str) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}"
            for e in validator(ref).iter_errors(instance)]


class SpecCheck:
    def __init__(self):
        self.violations: list[str] = []
        self.checked = 0  # bodies and events validated (a test can assert the hook saw its traffic)

    def install(self, monkeypatch) -> SpecCheck:
        check = self
        sync_send, async_send = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request

        def handle_request(transport, request):
            return check.wrap(request, sync_send(transport, request))

        async def handle_async_request(transport, request):
            return check.wrap(request, await async_send(transport, request))

        monkeypatch.setattr(httpx.HTTPTransport, "handle_request", handle_request)
        monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", handle_async_request)
        return self

    def wrap(self, request: httpx.Request, response: httpx.Response) -> httpx.Response:
        path = request.url.path
        matched = [template for pattern, template in _PATHS if pattern.fullmatch(path)]
        if not matched or response.status_code == 499:
            return response
        where = f"{request.method} {path} -> {response.status_code}"
        stream = response.headers.get("content-type", "").startswith("text/event-stream")
        reader = _Reader(self, matched[0], request.method.lower(), response.status_code, stream, where)
        response.stream = _Tee(response.stream, reader)
        return response

    def check_body(self, method: str, path: str, status: int, content_type: str, body: bytes) -> None:
        """A response read by another client (schemathesis' requests): the same checks as ``wrap``."""
        matched = [template for pattern, template in _PATHS if pattern.fullmatch(path)]
        if not matched or status == 499:
            return
        reader = _Reader(self, matched[0], method.lower(), status, content_type.startswith("text/event-stream"),
                         f"{method} {path} -> {status}")
        reader.feed(body)
        reader.close()

    def check(self, instance, ref: str, where: str) -> None:
        self.checked += 1
        self.violations += [f"{where}: {e}" for e in errors_of(instance, ref)]


class _Reader:
    """Validates a body as it arrives: whole for JSON, event by event for SSE."""

    def __init__(self, check: SpecCheck, template: str | None, method: str, status: int, stream: bool, where: str):
        self.check, self.template, self.method, self.status = check, template, method, status
        self.stream, self.where = stream, where
        self.buffer = b""

    def feed(self, data: bytes) -> None:
        self.buffer += data
        if not self.stream:
            return
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            self._event(event.decode())

    def close(self) -> None:
        if not self.stream and self.buffer and (self.template is not None or self.status >= 400):
            try:
                body = json.loads(self.buffer)
            except ValueError:
                self.check.violations.append(f"{self.where}: the body is not JSON: {self.buffer[:120]!r}")
                return
            self.check.check(body, _schema_ref(self.template, self.method, self.status, False), self.where)
        self.buffer = b""

    def _event(self, text: str) -> None:
        data = "\n".join(line[5:].removeprefix(" ") for line in text.split("\n") if line.startswith("data:"))
        if not data or data == "[DONE]":
            return
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload and "object" not in payload:
            self.check.check(payload, "#/components/schemas/ErrorResponse", f"{self.where} (SSE error event)")
            return
        template = self.template or _BY_OBJECT.get(payload.get("object"), "/chat/completions")
        self.check.check(payload, _schema_ref(template, "post", 200, True), f"{self.where} (SSE event)")


class _Tee(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, inner, reader: _Reader):
        self.inner, self.reader = inner, reader

    def __iter__(self):
        for chunk in self.inner:
            self.reader.feed(chunk)
            yield chunk

    async def __aiter__(self):
        async for chunk in self.inner:
            self.reader.feed(chunk)
            yield chunk

    def close(self) -> None:
        self.reader.close()
        self.inner.close()

    async def aclose(self) -> None:
        self.reader.close()
        await self.inner.aclose()
