"""A request's results as an HTTP response: an SSE stream, or one JSON body when the client waits.

Both count the client as attached to the request while it reads (core.attach)
and let go when it stops (core.detach): a client that leaves before the
terminal event is cancelled unless it (or a retry) comes back within the grace
period. Starlette cancels a streaming response's iterator when the client
disconnects; the detach is spawned as its own task because nothing awaited in
a cancelled task survives.

A failure after the stream started cannot change the status line, so it is an
SSE event ``data: {"error": {...}}`` followed by ``data: [DONE]`` (the Responses
API's ``error`` event instead). A non-stream request answers with the error's
own status instead. Every event has an ``id:`` (sse.py says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services import hops
from services.errors import PdserveError, RequestAbortedError
from services.gateway import direct_write, fanout_probe, metrics, sse
from services.gateway.core import HEARTBEAT, GatewayCore
from services.gateway.direct_write import DirectWriter
from services.gateway.http_errors import as_pdserve, error_body, error_response, event_error
from services.gateway.openai_format import ResponseAggregate, StreamFormatter
from services.gateway.request_record import COMPLETION, RequestRecord
from services.queue.results import CHUNK, ERROR, FINAL

log = logging.getLogger(__name__)


def _final_outcome(data: dict) -> str:
    return "aborted" if data.get("finish_reason") == "abort" else "ok"


class EventFormatter(Protocol):
    """What a stream's events look like: OpenAI chunks (openai_format) or Responses API events (responses_api)."""

    done: bool  # end with data: [DONE]

    def opening(self) -> list[dict]: ...
    def chunk(self, data: dict) -> list[dict]: ...
    def final(self, data: dict) -> list[dict]: ...
    def failure(self, body: dict) -> list[dict]: ...
    def event_name(self, payload: dict) -> str | None: ...


class DirectSlot:
    """Where a stream's response puts its DirectWriter when it starts (SSEResponse); None: every chunk goes
    through the stream's task."""

    writer: DirectWriter | None = None


async def sse_events(core: GatewayCore, record: RequestRecord, resume: sse.ResumePoint, fmt: EventFormatter,
                     api: str, started: float | None = None,
                     prepare: Callable[[], Awaitable[None]] | None = None,
                     admitted: float | None = None, slot: DirectSlot | None = None) -> AsyncIterator[bytes]:
    """The SSE body: ``started`` (perf_counter at arrival) is given for a fresh request, to measure TTFT;
    ``prepare`` runs first (inside the stream, so its failure is an error event too); ``admitted``
    (perf_counter once queued) with ``started`` records the request's phases (metrics.observe_phases).
    With a ``slot`` whose writer is set, chunks that arrive while this waits are written by the delivery
    reader (direct_write.py); they are formatted by the same code either way.

    Event ids follow sse.py: the events made from one result entry carry ``<entry>.<k>`` but
    the last, which carries ``<entry>``; a resume point inside an entry skips what was sent.
    """
    rid = record.request_id
    counted = finished = False
    outcome = "aborted"
    position = resume.event_id  # the id of the last event sent: where a resume would continue
    skip = resume.skip

    def encode(payload: dict, event_id: str) -> bytes:
        return sse.encode(payload, event_id, fmt.event_name(payload))

    def entry_events(entry_id: str, payloads: list[dict]) -> list[bytes]:
        nonlocal skip, position
        out = []
        for k, payload in enumerate(payloads):
            event_id = entry_id if k == len(payloads) - 1 else sse.sub_id(entry_id, k)
            if k >= skip:
                out.append(encode(payload, event_id))
            position = event_id
        skip = 0
        return out

    try:
        await core.attach(record)
        counted = True
        if prepare is not None:
            await prepare()
        if resume.opening:
            for payload in fmt.opening():
                position = sse.OPENING_ID
                yield encode(payload, position)
        first = True
        first_at = final = None
        failed: list[BaseException] = []  # a chunk the reader could not format: raised here, as an error event

        def chunk_events(entry_id: str, data: dict) -> list[bytes]:
            nonlocal first, first_at
            payloads = fmt.chunk(data)
            if payloads and first:
                hops.mark(rid, "gw.sse")
                if started is not None:
                    first_at = time.perf_counter()
                    metrics.observe_ttft(first_at - started)
                first = False
            return entry_events(entry_id, payloads)

        def write_now(event) -> bool:  # called by the delivery reader (delivery.Subscription.sink)
            entry_id, kind, data = event
            writer = slot.writer if slot is not None else None
            if kind != CHUNK or failed or writer is None or not writer.ready():
                return False
            try:
                out = chunk_events(entry_id, data)
            except Exception as exc:  # noqa: BLE001 - the stream's task raises it (below)
                failed.append(exc)
                return False
            if out:
                writer.write(b"".join(out))
                fanout_probe.written(record.stream_id, entry_id)
            return True

        events = core.follow(record, resume.after, direct=write_now if slot is not None else None)
        async with contextlib.aclosing(events):
            async for entry_id, kind, data in events:
                if failed:
                    raise failed[0]
                if kind == HEARTBEAT:
                    yield sse.HEARTBEAT
                    continue
                if kind == CHUNK:
                    out = chunk_events(entry_id, data)
                    for event in out:
                        yield event
                    if out:
                        direct_write.count_task_chunk()
                        fanout_probe.written(record.stream_id, entry_id)  # its events are in the transport
                    continue
                if kind == FINAL:
                    payloads = fmt.final(data)
                    outcome = _final_outcome(data)
                    final = data
                elif kind == ERROR:
                    payloads = fmt.failure(error_body(event_error(data)))
                    outcome = "error"
                else:
                    continue
                for event in entry_events(entry_id, payloads):
                    yield event
        finished = True
        if started is not None and outcome == "ok":
            now = time.perf_counter()
            metrics.observe_e2e(now - started)
            if admitted is not None:
                metrics.observe_phases(started, admitted, first_at, now, final)
        if fmt.done:
            yield sse.done(position)
    except Exception as exc:  # the status line is gone: the error becomes an event
        outcome = metrics.outcome_of(exc)
        exc = as_pdserve(exc)  # Redis trouble is a 503 event, not a traceback per stream
        if not isinstance(exc, PdserveError):
            log.exception("request %s: stream failed", rid)
        for payload in fmt.failure(error_body(exc)):
            yield encode(payload, position)  # not content: resuming after it repeats nothing
        if fmt.done:
            yield sse.done(position)
    finally:
        metrics.count(api, outcome)
        core.detach(record, counted, finished)


def stream_response(core: GatewayCore, record: RequestRecord, last_id: str, include_usage: bool, api: str,
                    headers: dict[str, str], started: float | None = None,
                    admitted: float | None = None) -> StreamingResponse:
    resume = sse.resume_point(last_id)
    fmt = StreamFormatter(record, include_usage)
    prepare = None
    if record.kind == COMPLETION and record.logprobs is not None and resume.after != sse.START:

        async def count_offset() -> None:  # text_offset counts the output sent before the resume point
            fmt.logprobs.text_offset = await core.text_before(record.stream_id, resume.after)

        prepare = count_offset

    slot = DirectSlot()
    return sse_stream(sse_events(core, record, resume, fmt, api, started, prepare, admitted, slot), headers, slot)


class SSEResponse(StreamingResponse):
    """A streaming response that, when it starts, gives its body's ``DirectSlot`` the connection's writer."""

    def __init__(self, content, slot: DirectSlot | None = None, **kwargs):
        super().__init__(content, **kwargs)
        self.slot = slot

    async def __call__(self, scope, receive, send):
        if self.slot is not None:
            self.slot.writer = DirectWriter.of(scope)
        await super().__call__(scope, receive, send)


def sse_stream(body: AsyncIterator[bytes], headers: dict[str, str], slot: DirectSlot | None = None) -> SSEResponse:
    """``slot``: the one given to the body's sse_events, for chunks written from the delivery reader."""
    return SSEResponse(body, slot, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Aggregate(Protocol):
    """A whole response from a request's chunk events: openai_format.ResponseAggregate or the Responses API's."""

    def add(self, data: dict) -> None: ...
    def body(self, final: dict) -> dict: ...


async def collect(core: GatewayCore, record: RequestRecord, started: float, aggregate: Aggregate,
                   admitted: float | None = None) -> tuple[dict | PdserveError, str]:
    """The response body and outcome, or the error event's error; raises when no terminal event came."""
    first = True
    first_at = None
    events = core.follow(record, "0")
    async with contextlib.aclosing(events):
        async for _, kind, data in events:
            if kind == CHUNK:
                if first:
                    first_at = time.perf_counter()
                    metrics.observe_ttft(first_at - started)
                    first = False
                aggregate.add(data)
            elif kind == FINAL:
                outcome = _final_outcome(data)
                if admitted is not None and outcome == "ok":
                    metrics.observe_phases(started, admitted, first_at, time.perf_counter(), data)
                return aggregate.body(data), outcome
            elif kind == ERROR:
                return event_error(data), "error"
    raise RequestAbortedError(f"the result stream of request {record.request_id} ended without a final event")


async def json_response(core: GatewayCore, request: Request, record: RequestRecord, api: str,
                        headers: dict[str, str], started: float, aggregate: Aggregate | None = None,
                        admitted: float | None = None) -> Response:
    """Wait for the whole result; a client that leaves meanwhile is detached (and so cancelled)."""
    await core.attach(record)
    work = asyncio.ensure_future(collect(core, record, started, aggregate or ResponseAggregate(record), admitted))
    gone = asyncio.ensure_future(wait_disconnect(request))
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
        core.detach(record, True, finished)
