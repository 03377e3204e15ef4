"""``n`` > 1 and ``best_of``: one request of several choices, their outputs merged into one response.

The request is admitted once (``core.submit``: one queue entry carrying ``choices``, one rate-limit
charge for every choice) and runs as one forked generation: the prompt computed once, the choices
sharing its KV blocks (services/engine/choices.py); choice i is seeded with seed + i when the
request has a seed (as vLLM V1 does). Each choice has its own request id and result stream
(``choice_id``; router/choices.py says why), followed, counted and cancelled as a request's is,
so everything below merges per-choice streams.

The merged response numbers its choices ``index`` 0..n-1, keeps each choice's ``finish_reason``
and logprobs, and counts the prompt once in ``usage`` and the completion tokens of every choice
(of every candidate, with ``best_of``, as OpenAI bills them). The client leaving detaches every
child (so each is cancelled); one child's failure ends the response with its error, a stream's
as a final error event, and the other children are detached (cancelled) too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.errors import PdserveError
from services.gateway import metrics, sse
from services.gateway.core import HEARTBEAT, Admission, GatewayCore
from services.gateway.http_admission import Admitted
from services.gateway.http_errors import as_pdserve, error_body, error_response, event_error
from services.gateway.openai_format import ResponseAggregate, StreamFormatter, usage
from services.gateway.request_record import RequestRecord, choice_records
from services.gateway.responses import collect, sse_stream, wait_disconnect
from services.queue.results import CHUNK, ERROR, FINAL

log = logging.getLogger(__name__)


def records_of(req, first: Admission) -> list[RequestRecord]:
    """Every choice's record: ``first`` was admitted as the request's one queue entry, with ``choices`` (a retry
    with its Idempotency-Key attached to it, and so to every choice it has)."""
    return choice_records(first.record, req.candidates)


async def attach_all(core: GatewayCore, records: list[RequestRecord]) -> None:
    """Count the client on every choice; if one cannot be joined, let go of all (the others are cancelled)."""
    attached = 0
    try:
        for record in records:
            await core.attach(record)
            attached += 1
    except Exception:
        for k, record in enumerate(records):
            core.detach(record, k < attached, False)
        raise


def sum_usage(parts: list[dict]) -> dict:
    """The prompt once (as the first choice counted it), every choice's completion tokens summed."""
    out = dict(parts[0])
    out["completion_tokens"] = sum(p["completion_tokens"] for p in parts)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def merge_usage(finals: list[dict], records: list[RequestRecord], seen: list[int]) -> dict:
    return sum_usage([usage(f, r, s) for f, r, s in zip(finals, records, seen)])


def best(candidates: list, n: int, cumulative_logprob) -> list:
    """best_of: the n candidates with the highest cumulative logprob, likeliest first."""
    return sorted(candidates, key=cumulative_logprob, reverse=True)[:n]


def _cumulative_logprob(choice: dict) -> float:
    return sum((choice.get("logprobs") or {}).get("token_logprobs") or [])


def merge_bodies(bodies: list[dict], n: int, ranked: bool, keep_logprobs: bool) -> dict:
    """One response from the children's: with ``ranked`` (best_of) the n likeliest choices, else all in order."""
    choices = [b["choices"][0] for b in bodies]
    if ranked:
        choices = best(choices, n, _cumulative_logprob)
    for i, choice in enumerate(choices):
        choice["index"] = i
        if not keep_logprobs:
            choice["logprobs"] = None
    return {**bodies[0], "choices": choices, "usage": sum_usage([b["usage"] for b in bodies])}


async def json_response(core: GatewayCore, request: Request, a: Admitted, records: list[RequestRecord],
                        api: str) -> Response:
    """Wait for every child; the first error, or the client leaving, ends it (and cancels the rest)."""
    await attach_all(core, records)
    works = [asyncio.ensure_future(collect(core, r, a.started, ResponseAggregate(r))) for r in records]
    gone = asyncio.ensure_future(wait_disconnect(request))
    finished = False
    try:
        pending = set(works)
        while pending:
            done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                metrics.count(api, "aborted")
                return Response(status_code=499)
            pending.discard(gone)
            for work in done:
                try:
                    body, outcome = work.result()
                except Exception as exc:
                    metrics.count(api, metrics.outcome_of(exc))
                    return error_response(exc, a.headers)
                if isinstance(body, PdserveError):
                    metrics.count(api, outcome)
                    return error_response(body, a.headers)
        finished = True
        results = [w.result() for w in works]
        outcome = "aborted" if any(o != "ok" for _, o in results) else "ok"
        metrics.count(api, outcome)
        merged = merge_bodies([b for b, _ in results], a.req.n, a.req.best_of is not None,
                              keep_logprobs=not a.req.hide_logprobs)
        return JSONResponse(merged, headers=a.headers)
    finally:
        for task in (*works, gone):
            task.cancel()
        for record in records:
            core.detach(record, True, finished)


async def _pump(core: GatewayCore, i: int, record: RequestRecord, out: asyncio.Queue) -> None:
    """Child i's events onto the merged stream's queue: (i, kind, data); a failure is an ERROR of its own."""
    try:
        async for _, kind, data in core.follow(record, sse.START):
            await out.put((i, kind, data))
            if kind in (FINAL, ERROR):
                return
        await out.put((i, ERROR, None))
    except Exception as exc:
        await out.put((i, "raised", exc))


async def interleave(core: GatewayCore, records: list[RequestRecord]) -> AsyncIterator[tuple[int, str, object]]:
    """Every choice's events as they come, as (choice index, kind, data), heartbeats included, until each
    choice has had its FINAL or one has had an ERROR (the last event then; data None: its result stream ended
    without a final event). A choice whose stream raised re-raises here. Closing it stops every follower."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(core, i, r, queue)) for i, r in enumerate(records)]
    left = len(records)
    try:
        while left:
            i, kind, data = await queue.get()
            if kind == "raised":
                raise data
            yield i, kind, data
            if kind == ERROR:
                return
            left -= kind == FINAL
    finally:
        for task in tasks:
            task.cancel()


def _tag(payloads: list[dict], i: int) -> list[dict]:
    for payload in payloads:
        for choice in payload.get("choices") or []:
            choice["index"] = i
    return payloads


async def stream_events(core: GatewayCore, a: Admitted, records: list[RequestRecord], api: str) -> AsyncIterator[bytes]:
    """The children's chunks interleaved as they come, each tagged with its choice index; one usage chunk
    (include_usage) after the last choice ends. Event ids count the events: an n > 1 stream is not resumable."""
    fmts = [StreamFormatter(r, a.req.include_usage) for r in records]
    counted = finished = False
    outcome = "aborted"
    count = 0

    def encode(payload: dict) -> bytes:
        nonlocal count
        count += 1
        return sse.encode(payload, str(count))

    try:
        await attach_all(core, records)
        counted = True
        for i, fmt in enumerate(fmts):
            for payload in _tag(fmt.opening(), i):
                yield encode(payload)
        finals: list[dict | None] = [None] * len(records)
        async with contextlib.aclosing(interleave(core, records)) as events:
            async for i, kind, data in events:
                if kind == HEARTBEAT:
                    yield sse.HEARTBEAT
                    continue
                if kind == CHUNK:
                    payloads = fmts[i].chunk(data)
                elif kind == FINAL:
                    finals[i] = data
                    payloads = [p for p in fmts[i].final(data) if p["choices"]]  # usage: once, merged, at the end
                elif kind == ERROR:
                    body = error_body(event_error(data)) if data is not None else error_body(
                        PdserveError(f"the result stream of choice {i} ended without a final event"))
                    outcome = "error"
                    for payload in fmts[i].failure(body):
                        yield encode(payload)
                    yield sse.done(str(count))
                    return
                else:
                    continue
                for payload in _tag(payloads, i):
                    yield encode(payload)
        outcome = "aborted" if any(f.get("finish_reason") == "abort" for f in finals) else "ok"
        if a.req.include_usage:
            seen = [f.completion_tokens for f in fmts]
            yield encode(fmts[0]._chunk([], usage=merge_usage(finals, records, seen)))
        finished = True
        yield sse.done(str(count))
    except Exception as exc:  # the status line is gone: the error becomes an event
        outcome = metrics.outcome_of(exc)
        exc = as_pdserve(exc)
        if not isinstance(exc, PdserveError):
            log.exception("request %s: n > 1 stream failed", records[0].request_id)
        yield encode(error_body(exc))
        yield sse.done(str(count))
    finally:
        metrics.count(api, outcome)
        if counted:  # else attach_all let go of them already
            for record in records:
                core.detach(record, True, finished)


def stream_response(core: GatewayCore, a: Admitted, records: list[RequestRecord], api: str):
    return sse_stream(stream_events(core, a, records, api), a.headers)
