"""Token chunks to Redis result streams: one pipelined write per engine step, in order.

The engine thread hands each step's outputs to ``on_step`` (before delivering
them to their streams); the chunks of every results-mode request in that step
become one batch, and one writer task sends batches in order, merging any that
queued up while a write was in flight. A request's Finish goes out on its
Decode stream only after ``flushed`` says its last chunk is in Redis, so the
router's final event can never overtake a chunk.

Every write costs the worker, Redis, the gateway and the client a wake-up and
CPU on the machine the engine runs on, so a request's tokens may be held and
written several to a chunk; its first token and the tokens of the step that
finishes it always go at once, so neither the first token nor the end waits,
and tokens held when a request ends without new ones (an abort) are written
with that step. Two ways to hold, one at a time:

- ``flush_ms`` M > 0 (``--stream-flush-ms``, the default; stream_holding.py):
  at most one write per request per M ms. A step that comes M ms or more
  after the request's last write writes what it held and its own tokens.
  Steps slower than M ms (a big batch, a slow machine) are written one by one
  as with no holding; fast steps (one user on a small model) coalesce. A held
  token waits at most M ms plus one step while its request runs (a preempted
  request's held tokens go with its next step).
- ``interval`` N > 1 (``--stream-interval``, vLLM's and SGLang's flag):
  N tokens to a chunk. ``interval`` 1 with ``flush_ms`` 0 writes every step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from services import hops, stream_holding, telemetry
from services.engine.outputs import RequestOutput
from services.queue.results import ResultWriter

log = logging.getLogger(__name__)


def chunk_event(out: RequestOutput, token_text: Callable[[int], str] | None,
                held: list[RequestOutput] = ()) -> dict:
    """The chunk of ``out``, after the outputs ``held`` back for it (their tokens first, in order)."""
    outs = [*held, out]
    data: dict = {"token_ids": [t for o in outs for t in o.new_token_ids], "text": "".join(o.new_text for o in outs)}
    logprobs = [lp for o in outs for lp in (o.logprobs or ()) if lp is not None]
    if logprobs:
        text = token_text or (lambda _t: "")
        data["logprobs"] = [
            {"token_id": lp.token_id, "token": text(lp.token_id), "logprob": lp.logprob,
             "top": [{"token_id": t, "token": text(t), "logprob": p} for t, p in lp.top]}
            for lp in logprobs]
    return data


class StepResultWriter:
    def __init__(self, redis, token_text: Callable[[int], str] | None = None, ttl_s: int = 600, worker_id: str = "",
                 interval: int = 1, flush_ms: float = 0.0, clock: Callable[[], float] = time.perf_counter):
        stream_holding.check(interval, flush_ms)
        self.writer = ResultWriter(redis, ttl_s)
        self.interval = interval
        self.flush_s = flush_ms / 1e3
        self.clock = clock  # seconds; a test drives it
        self._wrote_at: dict[str, float] = {}  # engine request id -> clock() of its last write (flush_ms)
        self._held: dict[str, list[RequestOutput]] = {}  # engine request id -> outputs not written yet (interval)
        # the token metrics of the requests written here, taken per step on the engine thread (their streams
        # see only the last output: AsyncEngine.finals_only)
        self._tokens = telemetry.GENERATION_TOKENS.labels("decode", worker_id)
        self._itl = telemetry.INTER_TOKEN_LATENCY_SECONDS.labels(role="decode")
        self._last_token_at: dict[str, float] = {}
        self.first_at: dict[str, float] = {}  # engine request id -> perf_counter() of its first token's step
        self.token_text = token_text
        self.targets: dict[str, str] = {}  # engine request id -> client request id (result stream)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batches: asyncio.Queue = asyncio.Queue()
        self._enqueued = 0
        self._written = 0
        self._last_batch: dict[str, int] = {}
        self._progress = asyncio.Condition()
        self._lost: dict[str, Exception] = {}  # engine request id -> why a chunk of it was not written
        self._task: asyncio.Task | None = None
        self._first_marked: set[str] = set()  # engine request ids whose first token the hop probe saw
        self._written_marked: set[str] = set()
        self.steps_written = 0  # pipelines sent (a test counts them against steps)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="step-results")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def track(self, request_id: str, results_to: str) -> None:
        self.targets[request_id] = results_to

    def untrack(self, request_id: str) -> None:
        self.targets.pop(request_id, None)
        self._last_batch.pop(request_id, None)
        self._lost.pop(request_id, None)
        self._first_marked.discard(request_id)
        self._written_marked.discard(request_id)
        self._last_token_at.pop(request_id, None)
        self.first_at.pop(request_id, None)
        self._held.pop(request_id, None)
        self._wrote_at.pop(request_id, None)

    # engine thread
    def on_step(self, outputs: list[RequestOutput], step: int | None = None) -> None:
        mine = [out for out in outputs if out.request_id in self.targets and (out.new_token_ids or out.new_text)]
        items = [(out.request_id, self.targets[out.request_id], chunk_event(out, self.token_text, held))
                 for out, held in self._due(mine, outputs)]
        if mine:
            now = time.perf_counter()
            self._tokens.inc(sum(len(out.new_token_ids) for out in mine))
            for out in mine:
                last = self._last_token_at.get(out.request_id)
                if last is None:
                    self.first_at[out.request_id] = now
                elif out.new_token_ids:
                    self._itl.observe(now - last)
                self._last_token_at[out.request_id] = now
        if items and hops.enabled():
            for engine_rid, rid, _ in items:
                if engine_rid not in self._first_marked:
                    self._first_marked.add(engine_rid)
                    hops.mark(rid, "decode.token", step=step)
        if items:
            self._loop.call_soon_threadsafe(self._enqueue, items)

    def _due(self, mine: list[RequestOutput], outputs: list[RequestOutput]):
        """``(output, the outputs held back for it)`` to write this step; with no holding, every output."""
        if self.interval == 1 and not self.flush_s:
            return [(out, ()) for out in mine]
        due = []
        now = self.clock() if self.flush_s else 0.0
        for out in mine:
            held = self._held.setdefault(out.request_id, [])
            wrote_at = self._wrote_at.get(out.request_id)
            if self.flush_s:
                ready = wrote_at is not None and now - wrote_at >= self.flush_s
            else:
                ready = len(out.new_token_ids) + sum(len(o.new_token_ids) for o in held) >= self.interval
            if wrote_at is None or out.finished or ready:
                due.append((out, self._held.pop(out.request_id, held)))
                self._wrote_at[out.request_id] = now
            else:
                held.append(out)
        for out in outputs:  # ended with nothing new (an abort): what it held goes now
            if out.finished and self._held.get(out.request_id) and out.request_id in self.targets:
                held = self._held.pop(out.request_id, [])
                if held:
                    due.append((held.pop(), held))
        return due

    def _enqueue(self, items: list[tuple[str, str, dict]]) -> None:
        self._enqueued += 1
        for engine_rid, _, _ in items:
            self._last_batch[engine_rid] = self._enqueued
        self._batches.put_nowait((self._enqueued, items))

    async def _run(self) -> None:
        while True:
            seq, items = await self._batches.get()
            while not self._batches.empty():  # writes fell behind: merge, order kept
                seq, more = self._batches.get_nowait()
                items += more
            try:
                await self.writer.append_chunks([(rid, data) for _, rid, data in items],
                                                 attempts=[engine_rid for engine_rid, _, _ in items])
                self.steps_written += 1
                if hops.enabled():
                    for engine_rid, rid, _ in items:
                        if engine_rid not in self._written_marked:
                            self._written_marked.add(engine_rid)
                            hops.mark(rid, "decode.written")
            except Exception as exc:  # Redis away: the requests whose chunks these were fail
                log.warning("writing result chunks failed: %s", exc)
                for engine_rid, _, _ in items:
                    self._lost[engine_rid] = exc
            async with self._progress:
                self._written = seq
                self._progress.notify_all()

    async def flushed(self, request_id: str) -> None:
        """Wait until every chunk of ``request_id`` handed to ``on_step`` so far is written."""
        target = self._last_batch.get(request_id, 0)
        async with self._progress:
            await self._progress.wait_for(lambda: self._written >= target)
        if request_id in self._lost:
            raise RuntimeError(f"cannot write results to Redis: {self._lost.pop(request_id)}")
