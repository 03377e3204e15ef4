"""The router's consumer of the admission queue: dequeue fairly, dispatch, finalize.

    loop: while fewer than max_inflight requests run, take deliveries (weighted-fair
          across tiers) and start one task each; every claim_idle_ms / 3, touch the
          running entries (so no other router reclaims live work) and reclaim what
          a dead router left pending for claim_idle_ms.
    task: dispatch, reading the cancel flag beside it (set: cancelled -> final "abort", ack)
          tokens already in its result stream (a redelivery) -> resume after them
          Dispatcher.generate(results_to=request id): decode workers write the chunks
          -> final event (usage, timings with queue wait) -> ack
          model "auto" (a cascade spec): router/cascade.py runs the tiers and writes the chunks
          failure -> consumer.fail: retried (re-queued) or, after max_deliveries,
          dead-lettered with an error event for the client
    cancel: PUBLISH on the cancel channel (the gateway's client left) cancels the
          task, which cancels the worker calls and frees their blocks.

The ack comes only after the final event is in the result stream, so a router
that dies at any point leaves either a finished request (skipped on
redelivery) or a pending one that another router resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services import hops, telemetry
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError, PdserveError
from services.loops import Loops
from services.queue import QueueConfig, QueueConsumer
from services.queue.cancel import CANCEL_CHANNEL, is_cancelled
from services.queue.consumer import Delivery
from services.queue.keys import result_stream, tier_stream
from services.queue.results import CHUNK, ResultReader, ResultWriter, decode_event
from services.cascade import CascadeSpec
from services.router.cascade import run_cascade
from services.router.choices import run_choices
from services.router.dispatch import Dispatcher

log = logging.getLogger(__name__)
ATTEMPTS_PER_DELIVERY = 100  # attempt numbers reserved per delivery (dispatch caps --max-attempts far below)


class QueueWorker:
    def __init__(self, redis, dispatcher: Dispatcher, config: QueueConfig | None = None, max_inflight: int = 64,
                 consumer: str | None = None):
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.redis = redis
        self.dispatcher = dispatcher
        self.config = config or QueueConfig()
        self.consumer = QueueConsumer(redis, consumer=consumer, config=self.config)
        self.results = ResultWriter(redis, self.config.result_ttl_s)
        self.reader = ResultReader(redis)
        self.choice_of: dict[str, str] = {}  # choice i's request id (i >= 1) -> its request's, while it runs
        self.max_inflight = max_inflight
        self.running: dict[str, tuple[Delivery, asyncio.Task]] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._loops = Loops()

    async def start(self) -> None:
        await self.consumer.ensure_groups()
        self._loops.start({"queue-consume": self._consume, "queue-maintain": self._maintain,
                             "queue-cancels": self._listen_cancels})

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stop taking work; give running requests ``drain_s``, then cancel them (left pending: reclaimed)."""
        await self._loops.stop(1.0)
        running = [task for _, task in self.running.values()]
        if running and drain_s > 0:
            await asyncio.wait(running, timeout=drain_s)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    # ---- loops ----------------------------------------------------------
    async def _consume(self) -> None:
        while not self._loops.stopping:
            await self._room.wait()
            try:
                deliveries = await self.consumer.next(count=self.max_inflight - len(self.running), block_ms=500)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: back off, the entries stay queued
                log.warning("reading the admission queue failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for d in deliveries:
                self._start(d)

    def _start(self, d: Delivery) -> None:
        if d.request_id in self.running:  # a duplicate delivery of work in hand
            return
        hops.mark(d.request_id, "router.read")
        task = asyncio.create_task(self._handle(d), name=f"request-{d.request_id}")
        self.running[d.request_id] = (d, task)
        for rid in d.request.choice_ids[1:]:  # cancelling any choice cancels the generation they share
            self.choice_of[rid] = d.request_id
        if len(self.running) >= self.max_inflight:
            self._room.clear()

        def done(_t: asyncio.Task) -> None:
            self.running.pop(d.request_id, None)
            for rid in d.request.choice_ids[1:]:
                self.choice_of.pop(rid, None)
            self._room.set()

        task.add_done_callback(done)

    async def _maintain(self) -> None:
        interval = self.config.claim_idle_ms / 3000
        while not self._loops.stopping:
            await asyncio.sleep(interval)
            try:
                for d, _ in list(self.running.values()):  # reset their idle time: they are alive
                    await self.redis.xclaim(tier_stream(d.tier), self.consumer.group, self.consumer.consumer, 0,
                                            [d.entry_id], justid=True)
                if len(self.running) < self.max_inflight:
                    for d in await self.consumer.reclaim(count=self.max_inflight - len(self.running)):
                        log.info("reclaimed %s (delivery %d) from a silent router", d.request_id, d.delivery_count)
                        self._start(d)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("queue maintenance failed: %s", exc)

    async def _listen_cancels(self) -> None:
        while not self._loops.stopping:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(CANCEL_CHANNEL)
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    rid = msg["data"].decode() if isinstance(msg["data"], bytes) else msg["data"]
                    entry = self.running.get(self.choice_of.get(rid, rid))
                    if entry is not None:
                        log.info("request %s cancelled by its client", rid)
                        entry[1].cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cancel channel failed: %s; resubscribing", exc)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # ---- one request ----------------------------------------------------
    async def _handle(self, d: Delivery) -> None:
        req = d.request
        queue_ms = max(0.0, (time.time() - req.enqueued_at) * 1e3)
        telemetry.QUEUE_WAIT_SECONDS.labels(role="router").observe(queue_ms / 1e3)
        parent = telemetry.context_from_carrier({"traceparent": req.traceparent} if req.traceparent else {})
        tracer = telemetry.tracer("pdserve.router")
        tracer.start_span("queue_wait", context=parent, start_time=int(req.enqueued_at * 1e9),
                          attributes={"request_id": req.request_id, "tier": d.tier}).end()
        with tracer.start_as_current_span("route", context=parent,
                                          attributes={"request_id": req.request_id, "tier": d.tier,
                                                      "delivery": d.delivery_count}):
            timer = _until(req.deadline)
            try:
                try:
                    params = SamplingParams(**req.sampling)
                except (TypeError, ValueError) as exc:  # an unknown field, a value out of range: bad input
                    raise InvalidRequestError(f"bad sampling parameters: {exc}") from None
                finish = None
                # A client that left while its request queued set the cancel flag (its PUBLISH found no
                # task to cancel). The flag is read beside the dispatch, not before it: one Redis round
                # trip off every request's first token; a set flag cancels this task, as a PUBLISH would.
                extra = {}
                async with timer:
                    with self._cancelled_by_flag(req.request_id):
                        if req.choices > 1:  # n choices: router/choices.py writes their events and acks
                            await run_choices(self, d, params, queue_ms,
                                              (d.delivery_count - 1) * ATTEMPTS_PER_DELIVERY)
                            return
                        if req.cascade:
                            outcome = await run_cascade(self.dispatcher, self.results,
                                                        CascadeSpec.from_json(req.cascade), req.request_id,
                                                        req.token_ids, params, self._priority(d.tier),
                                                        req.deadline, req.session_key)
                            finish, extra = outcome.finish, {"model": outcome.model, "cascade": outcome.summary()}
                        else:
                            # a redelivered request's attempts are numbered on from the earlier router's, whose
                            # decode worker may still be writing: fence it off before reading what the stream
                            # holds
                            finish = await self.generate_into_stream(
                                req.request_id, req.token_ids, params, self._priority(d.tier), req.deadline,
                                req.session_key, req.model, (d.delivery_count - 1) * ATTEMPTS_PER_DELIVERY,
                                resume=d.delivery_count > 1)
                await self._final(d, {**extra, **self.final_event(finish, queue_ms)})
            except asyncio.CancelledError:
                # the client left (or this router is stopping: then the entry stays pending for another)
                if req.choices == 1 and await _quietly(is_cancelled(self.redis, req.request_id)):
                    await asyncio.shield(self._final(d, {"finish_reason": "abort", "usage": {},
                                                         "timings": {"queue_ms": queue_ms}}))
                raise
            except TimeoutError as exc:
                if not timer.expired():  # not the deadline's: a bug, as below
                    log.exception("request %s: unexpected failure", req.request_id)
                    await self.consumer.fail(d, f"{type(exc).__name__}: {exc}", self.consumer.consumer)
                    return
                # past its deadline mid-generation: the attempt was cancelled (its worker aborts it, freeing
                # the slot) and the client hears now, not when the gateway's own grace runs out
                log.info("request %s passed its deadline while generating; stopped", req.request_id)
                await self.consumer.expire(d, "the request's deadline passed while it was being generated")
            except PdserveError as exc:
                # bad input stays bad; anything else (no room, a worker or transfer failure) may pass later.
                # A TypeError or ValueError from the dispatch is a bug, not bad input: retried below.
                retryable = exc.http_status not in (400, 404)
                message, code = exc.message, exc.code
                outcome = await self.consumer.fail(d, message, self.consumer.consumer, retryable=retryable, code=code)
                log.warning("request %s failed (%s): %s", req.request_id, outcome, message)
                if outcome == "dead_lettered":
                    telemetry.DEAD_LETTERS.inc()
            except Exception as exc:  # a bug: retry on the next delivery rather than lose the request
                log.exception("request %s: unexpected failure", req.request_id)
                await self.consumer.fail(d, f"{type(exc).__name__}: {exc}", self.consumer.consumer)

    @contextlib.contextmanager
    def _cancelled_by_flag(self, request_id: str):
        """Read the request's cancel flag while the body runs; a set flag cancels the running task."""
        task = asyncio.current_task()
        check = asyncio.ensure_future(is_cancelled(self.redis, request_id))
        running = True  # a callback already scheduled when the body ended must not cancel what follows

        def checked(f: asyncio.Future) -> None:
            # a failed read cancels nothing: the dispatch's own Redis writes meet the same trouble
            if running and not f.cancelled() and f.exception() is None and f.result():
                log.info("request %s was cancelled by its client while queued", request_id)
                task.cancel()

        check.add_done_callback(checked)
        try:
            yield
        finally:
            running = False
            check.cancel()

    @staticmethod
    def final_event(finish, queue_ms: float) -> dict:
        """A request's final event (results.py) from its Finish and its time in the queue."""
        return {"finish_reason": finish.finish_reason,
                "usage": {"prompt_tokens": finish.usage.prompt_tokens,
                          "completion_tokens": finish.usage.completion_tokens,
                          "cached_prompt_tokens": finish.usage.cached_prompt_tokens},
                "timings": {"queue_ms": queue_ms, "ttft_ms": queue_ms + finish.timings.ttft_ms,
                            "e2e_ms": queue_ms + finish.timings.e2e_ms, "prefill_ms": finish.timings.prefill_ms},
                "prefill_worker": finish.prefill_worker, "decode_worker": finish.decode_worker}

    async def _final(self, d: Delivery, final: dict) -> None:
        await self.results.finish(d.request_id, final)
        await self.consumer.ack(d)

    async def generate_into_stream(self, rid: str, token_ids, params: SamplingParams, priority: int,
                                   deadline: float, session_key: str, model: str, base: int, resume: bool):
        """Generate ``rid`` into its own result stream, retrying as the dispatcher does (each retry fenced
        in, resuming from what the stream holds); ``resume``: an earlier attempt may have written there
        (a redelivery, a failed forked attempt), so fence it off and resume from the start too. Returns
        the last Finish (results mode: only the Finish comes back)."""
        emitted = []
        if resume:
            await self.results.fence(rid, f"{rid}.{base + 1}")
            emitted = await self._emitted(rid)
        finish = None
        async for finish in self.dispatcher.generate(
                rid, token_ids, params, priority, deadline, results_to=rid, emitted=emitted,
                read_emitted=lambda: self._emitted(rid), session_key=session_key,
                fence=lambda wrid: self.results.fence(rid, wrid), attempt_base=base, model=model):
            pass
        return finish

    async def _emitted(self, request_id: str) -> list[int]:
        """Token ids the request's result stream already holds (what its client has seen)."""
        tokens: list[int] = []
        for _, fields in await self.redis.xrange(result_stream(request_id)):
            kind, data = decode_event(fields)
            if kind == CHUNK:
                tokens.extend(data.get("token_ids", []))
        return tokens

    def _priority(self, tier: str) -> int:
        return self.config.tiers.index(tier) if tier in self.config.tiers else len(self.config.tiers)


def _until(deadline: float):
    """A timeout at the request's deadline (a unix time; 0: none): a generation past it is stopped here, so
    the worker frees its slot and the client hears at once, not when the gateway's own grace runs out."""
    loop = asyncio.get_running_loop()
    return asyncio.timeout_at(loop.time() + (deadline - time.time()) if deadline > 0 else None)


async def _quietly(awaitable) -> bool:
    try:
        return await asyncio.shield(awaitable)
    except Exception:
        return False
