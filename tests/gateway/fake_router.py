"""A scripted stand-in for the router and its prefill/decode workers, for gateway tests.

It consumes the REAL admission queue with ``QueueConsumer`` (weighted-fair
dequeue, ack at the final state) and writes each request's result stream with
the REAL ``ResultWriter``, exactly the events the router (final / error) and the
decode workers (chunks) write, but with scripted text instead of a model: the
gateway under test cannot tell the difference, and the tests can make it
stream slowly, fail mid-stream, or notice a cancellation.

Per request, ``plan(request)`` (a ``QueuedRequest``) returns a ``Plan``; by
default every request streams ``DEFAULT_PIECES``. A cancelled request (the
gateway set the cancel flag) stops between chunks with a final ``abort``, as the
real router does. An entry of n choices (``QueuedRequest.choices``) is served as the
router serves one that cannot fork: each choice as a request of its own (its id and
seed, ``choice_id`` / ``choice_sampling``), all seen, planned and written apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from services.queue import QueueConsumer, QueuedRequest, ResultWriter
from services.queue.cancel import is_cancelled
from services.queue.message import choice_sampling

DEFAULT_PIECES = ("Hello", ",", " wor", "ld", "!")


@dataclass
class Plan:
    pieces: tuple[str, ...] = DEFAULT_PIECES
    delay_s: float = 0.0  # between chunks
    error_after: int | None = None  # write an error event after this many chunks
    error: tuple[str, str, int] = ("kv_transfer_error", "decode worker lost", 502)
    finish_reason: str = "stop"
    hold: asyncio.Event | None = None  # wait for it before the first chunk


@dataclass
class FakeRouter:
    redis: object
    plan: Callable[[QueuedRequest], Plan] = field(default=lambda _req: Plan())
    seen: list[QueuedRequest] = field(default_factory=list)  # per choice (an entry of n choices: n of them)
    entries: list[QueuedRequest] = field(default_factory=list)  # the queue entries read
    tiers_seen: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.consumer = QueueConsumer(self.redis, consumer="fake-router")
        self.writer = ResultWriter(self.redis, ttl_s=120)
        self._tasks: set[asyncio.Task] = set()
        self.paused = False  # True: leave everything in the queue (see pause())
        self.idle = threading.Event()  # set while paused and not reading the queue
        self.stopping = False

    def pause(self, timeout_s: float = 5.0) -> None:
        """From the test's thread: stop dequeuing, and return once no dequeue is in flight."""
        self.paused = True
        if not self.idle.wait(timeout_s):
            raise TimeoutError("the fake router did not pause")

    async def run(self) -> None:
        """Serve until ``stopping`` (a flag, not a cancel: a cancel landing inside a redis-py call can be lost)."""
        while not self.stopping:
            if self.paused:
                self.idle.set()
                await asyncio.sleep(0.02)
                continue
            self.idle.clear()
            try:
                deliveries = await self.consumer.next(count=16, block_ms=50)
            except Exception:
                # redis-py (8.1) can turn a cancellation that lands mid-command into a ConnectionError:
                # honour the cancel rather than loop on, or this router outlives its test
                if asyncio.current_task().cancelling():
                    raise asyncio.CancelledError from None
                await asyncio.sleep(0.02)
                continue
            for d in deliveries:
                task = asyncio.create_task(self._serve(d))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _serve(self, d) -> None:
        self.entries.append(d.request)
        choices = [dataclasses.replace(d.request, request_id=rid, sampling=choice_sampling(d.request.sampling, i),
                                       choices=1) for i, rid in enumerate(d.request.choice_ids)]
        await asyncio.gather(*(self._serve_one(d, req) for req in choices))
        await self.consumer.ack(d)

    async def _serve_one(self, d, req: QueuedRequest) -> None:
        self.seen.append(req)
        self.tiers_seen.append(d.tier)
        plan = self.plan(req)
        if plan.hold is not None:
            await plan.hold.wait()
        want_logprobs = req.sampling.get("logprobs") is not None
        top_n = req.sampling.get("logprobs") or 0
        for i, piece in enumerate(plan.pieces):
            if await is_cancelled(self.redis, req.request_id):
                self.cancelled.append(req.request_id)
                await self.writer.finish(req.request_id, {"finish_reason": "abort", "usage": {}, "timings": {}})
                return
            if plan.error_after is not None and i == plan.error_after:
                await self.writer.error(req.request_id, *plan.error)
                return
            chunk = {"token_ids": [100 + i], "text": piece}
            if want_logprobs:
                chunk["logprobs"] = [{"token_id": 100 + i, "token": piece, "logprob": -0.25 * (i + 1),
                                      "top": [{"token_id": 200 + j, "token": f"alt{j}", "logprob": -1.0 - j}
                                              for j in range(top_n)]}]
            await self.writer.append_chunks([(req.request_id, chunk)])
            if plan.delay_s:
                await asyncio.sleep(plan.delay_s)
        await self.writer.finish(req.request_id, {
            "finish_reason": plan.finish_reason,
            "usage": {"prompt_tokens": req.prompt_tokens, "completion_tokens": len(plan.pieces),
                      "cached_prompt_tokens": 3},
            "timings": {"ttft_ms": 1.0, "e2e_ms": 2.0, "queue_ms": 0.5, "prefill_ms": 0.5},
            "prefill_worker": "fake-prefill", "decode_worker": "fake-decode"})
        self.finished.append(req.request_id)

    async def stop(self) -> None:
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
