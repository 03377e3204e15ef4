"""A request's results as an HTTP response: an SSE stream, or one JSON body when the client waits.

Both count the client as attached to the request while it reads (core.attach)
and let go when it stops (core.detach): a client that leaves before the
terminal event is cancelled unless it (or a retry) comes back within the grace
period. Starlette cancels a streaming response's iterator when the client
disconnects; the detach is spawned as its own task because nothing awaited in
a cancelled task survives.

A failure after the stream started cannot change the status line, so it is an
SSE event ``data: {"error": {...}}`` (with the entry id when it came from the
result stream) followed by ``data: [DONE]``. A non-stream request answers with
the error's own status instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.errors import PdserveError, RequestAbortedError
from services.gateway import metrics, sse
from services.gateway.core import HEARTBEAT, GatewayCore
from services.gateway.http_errors import as_pdserve, error_body, error_response, event_error
from services.gateway.openai_format import ResponseAggregate, StreamFormatter
from services.gateway.request_record import COMPLETION, RequestRecord
from services.queue.results import CHUNK, ERROR, FINAL

log = logging.getLogger(__name__)


def _final_outcome(data: dict) -> str:
    return "aborted" if data.get("finish_reason") == "abort" else "ok"


async def sse_events(core: GatewayCore, record: RequestRecord, last_id: str, include_usage: bool, api: str,
                     started: float | None = None) -> AsyncIterator[bytes]:
    """The SSE body: ``started`` (perf_counter at arrival) is given for a fresh request, to measure TTFT."""
    rid = record.request_id
    counted = finished = False
    outcome = "aborted"
    try:
        await core.attach(rid)
        counted = True
        offset = await core.text_before(rid, last_id) if record.kind == COMPLETION and record.logprobs is not None \
            else 0
        formatter = StreamFormatter(record, include_usage, offset)
        if last_id == "0" and (opening := formatter.opening()) is not None:
            yield sse.encode(opening)
        first = True
        events = core.follow(record, last_id)
        async with contextlib.aclosing(events):
            async for entry_id, kind, data in events:
                if kind == HEARTBEAT:
                    yield sse.HEARTBEAT
                elif kind == CHUNK:
                    chunk = formatter.chunk(data)
                    if chunk is not None:
                        if first and started is not None:
                            metrics.observe_ttft(time.perf_counter() - started)
                        first = False
                        yield sse.encode(chunk, entry_id)
                elif kind == FINAL:
                    *leading, last = formatter.final(data)
                    for chunk in leading:
                        yield sse.encode(chunk)
                    yield sse.encode(last, entry_id)  # the id goes on the last: resuming after it loses nothing
                    outcome = _final_outcome(data)
                elif kind == ERROR:
                    yield sse.encode(error_body(event_error(data)), entry_id)
                    outcome = "error"
        finished = True
        if started is not None and outcome == "ok":
            metrics.observe_e2e(time.perf_counter() - started)
        yield sse.DONE
    except Exception as exc:  # the status line is gone: the error becomes an event
        outcome = metrics.outcome_of(exc)
        exc = as_pdserve(exc)  # Redis trouble is a 503 event, not a traceback per stream
        if not isinstance(exc, PdserveError):
            log.exception("request %s: stream failed", rid)
        yield sse.encode(error_body(exc))
        yield sse.DONE
    finally:
        metrics.count(api, outcome)
        core.detach(rid, counted, finished)


def stream_response(core: GatewayCore, record: RequestRecord, last_id: str, include_usage: bool, api: str,
                    headers: dict[str, str], started: float | None = None) -> StreamingResponse:
    return StreamingResponse(sse_events(core, record, last_id, include_usage, api, started),
                             media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(core: GatewayCore, record: RequestRecord, started: float) -> tuple[dict | PdserveError, str]:
    """The response body and outcome, or the error event's error; raises when no terminal event came."""
    aggregate = ResponseAggregate(record)
    first = True
    events = core.follow(record, "0")
    async with contextlib.aclosing(events):
        async for _, kind, data in events:
            if kind == CHUNK:
                if first:
                    metrics.observe_ttft(time.perf_counter() - started)
                    first = False
                aggregate.add(data)
            elif kind == FINAL:
                return aggregate.body(data), _final_outcome(data)
            elif kind == ERROR:
                return event_error(data), "error"
    raise RequestAbortedError(f"the result stream of request {record.request_id} ended without a final event")


async def json_response(core: GatewayCore, request: Request, record: RequestRecord, api: str,
                        headers: dict[str, str], started: float) -> Response:
    """Wait for the whole result; a client that leaves meanwhile is detached (and so cancelled)."""
    rid = record.request_id
    await core.attach(rid)
    work = asyncio.ensure_future(_collect(core, record, started))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    finished = False
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            metrics.count(api, "aborted")
            return Response(status_code=499)  # nobody reads it; the status is for logs
        try:
            body, outcome = work.result()
        except Exception as exc:  # no terminal event (deadline passed, results expired): still cancel it
            metrics.count(api, metrics.outcome_of(exc))
            return error_response(exc, headers)
        finished = True
        metrics.count(api, outcome)
        if isinstance(body, PdserveError):
            return error_response(body, headers)
        if outcome == "ok":
            metrics.observe_e2e(time.perf_counter() - started)
        return JSONResponse(body, headers=headers)
    finally:
        for task in (work, gone):
            task.cancel()
        core.detach(rid, True, finished)
