"""An ``n`` > 1 request (``QueuedRequest.choices``): one forked generation, one result stream per choice.

    first delivery:  Dispatcher.generate_choices -> one decode worker computes the prompt once and forks
                     the choices off it (local prefill; services/engine/choices.py); each choice's chunks
                     go to its own result stream, its Finish comes back here tagged with its index
                     -> that choice's final event at once
    attempt failed:  every unfinished choice runs on as a request of its own (Dispatcher.generate, with
                     its retries), resuming from the tokens its stream holds (fenced first, as any retry)
                     -> no token lost or repeated; the sharing is lost for the rest of those choices
    redelivered:     the same, for each choice whose stream has no terminal event yet (and from the
                     start for structured output, a LoRA adapter or model "auto", which do not fork)
    cancelled:       an abort final for every unfinished choice (the gateway cancels a choice's id; the
                     queue worker maps it to this request's task)
    failed for good: an error event for each choice that failed (the gateway ends the response at the
                     first), then the entry is acked

Why a result stream per choice and not one stream with an index on every chunk: each stream is then
exactly a request's (the fence, the retry's resume from what the stream holds, SSE resume ids,
cancellation by request id, the gateway's delivery and reader counting all work per choice
unchanged), and the gateway merges choices as it merged fanned-out children. The cost is n result
writes per engine step instead of one; the decode worker's step writer pipelines them into its one
round trip anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.engine.sampling_params import SamplingParams
from services.errors import PdserveError
from services.queue.cancel import is_cancelled
from services.queue.consumer import Delivery
from services.queue.message import choice_sampling
from services.queue.results import TERMINAL
from services.router.dispatch import ChoicesFailed

log = logging.getLogger(__name__)


async def run_choices(qw, d: Delivery, params: SamplingParams, queue_ms: float, base: int) -> None:
    """Serve every choice of ``d`` (writing each one's final or error event), then ack it. ``qw``: the
    QueueWorker; ``base``: this delivery's first attempt number less one."""
    req = d.request
    ids = req.choice_ids
    done: set[int] = set()
    priority = qw._priority(d.tier)
    try:
        # structured output and LoRA choices do not fork (Engine.add_choices): they run alone, sharing the
        # prompt's full blocks through the prefix cache; so does model "auto" (each choice its cascade)
        if d.delivery_count == 1 and not req.cascade and params.structured is None and params.lora is None:
            done = await _forked(qw, d, params, queue_ms, base + 1)
            base += 1  # the forked attempt used that number
        else:  # a redelivery: choices that ended before the router died are done
            for i, rid in enumerate(ids):
                if await _ended(qw, rid):
                    done.add(i)
        left = [i for i in range(len(ids)) if i not in done]
        if left:
            await asyncio.gather(*(_alone(qw, d, i, queue_ms, base, priority) for i in left))
    except PdserveError as exc:  # before any choice could run (its deadline passed): every choice fails
        for rid in ids:
            if not await _ended(qw, rid):
                await qw.results.error(rid, exc.code, exc.message, exc.http_status)
    except asyncio.CancelledError:        # the client left (every choice's flag is set then), or this router is stopping (left pending)
        flagged = [await _quietly(is_cancelled(qw.redis, rid)) for rid in ids]
        if any(flagged):
            await asyncio.shield(_abort_all(qw, d, queue_ms))
        raise
    await qw.consumer.ack(d)


async def _forked(qw, d: Delivery, params: SamplingParams, queue_ms: float, attempt: int) -> set[int]:
    """The forked attempt: the choices that ended (their final events written)."""
    req = d.request
    ids = req.choice_ids
    done: set[int] = set()
    try:
        async for i, finish in qw.dispatcher.generate_choices(
                [f"{rid}.{attempt}" for rid in ids], req.token_ids, params, qw._priority(d.tier), req.deadline,
                ids, session_key=req.session_key, model=req.model):
            if i in done or not 0 <= i < len(ids):
                continue
            final = qw.final_event(finish, queue_ms)
            await qw.results.finish(ids[i], final)
            done.add(i)
    except ChoicesFailed as failed:
        if not failed.retryable:  # bad input stays bad: every choice fails with it
            for i, rid in enumerate(ids):
                if i not in done:
                    await qw.results.error(rid, failed.error.code, failed.error.message, failed.error.http_status)
                    done.add(i)
            return done
        log.warning("request %s: the forked attempt failed (%s); its %d unfinished choices run on alone",
                    req.request_id, failed.error.message, len(ids) - len(done))
    return done


async def _alone(qw, d: Delivery, i: int, queue_ms: float, base: int, priority: int) -> None:
    """Choice i as a request of its own, resuming from the tokens its stream holds."""
    req = d.request
    rid = req.choice_ids[i]
    try:
        params = SamplingParams(**choice_sampling(req.sampling, i))
        # an earlier attempt (the forked one, an earlier router's) may have written: fenced off, resumed from
        finish = await qw.generate_into_stream(rid, req.token_ids, params, priority, req.deadline,
                                               req.session_key, req.model, base, resume=True)
        await qw.results.finish(rid, qw.final_event(finish, queue_ms))
    except PdserveError as exc:
        log.warning("request %s: choice %d failed: %s", req.request_id, i, exc.message)
        await qw.results.error(rid, exc.code, exc.message, exc.http_status)
    except (TypeError, ValueError) as exc:
        await qw.results.error(rid, "invalid_request_error", f"bad sampling parameters: {exc}", 400)


async def _abort_all(qw, d: Delivery, queue_ms: float) -> None:
    for rid in d.request.choice_ids:
        if not await _ended(qw, rid):
            await qw.results.finish(rid, {"finish_reason": "abort", "usage": {}, "timings": {"queue_ms": queue_ms}})
    await qw.consumer.ack(d)


async def _ended(qw, rid: str) -> bool:
    """The choice's result stream holds its terminal event (written before; a redelivery skips it)."""
    last = await qw.reader.last_event(rid)
    return last is not None and last[1] in TERMINAL


async def _quietly(awaitable) -> bool:
    with contextlib.suppress(Exception):
        return await asyncio.shield(awaitable)
    return False
