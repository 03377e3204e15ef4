"""asyncio front for the engine: one background thread steps it; callers await streams.

Only the engine thread touches the Engine. Callers' add/abort calls are queued
and applied between steps; each request's outputs arrive on its own
asyncio.Queue through ``call_soon_threadsafe``. A caller that stops iterating
(client gone, task cancelled) aborts its request, which frees its blocks.

The engine thread holds the GIL for most of a step, dropping it only for
moments inside kernels, and takes it straight back; the event loop, woken by an
output, would wait for CPython's switch interval (5 ms by default) before it
gets the GIL to deliver it. Creating an AsyncEngine lowers the process's switch
interval to ``SWITCH_INTERVAL_S``, so a token reaches its stream within a
fraction of a millisecond while the next step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import sys
import threading
import time
from typing import AsyncIterator, Callable

from services.engine.engine import Engine
from services.engine.outputs import RequestOutput
from services.engine.request import Status
from services.engine.sampling_params import SamplingParams
from services import hops, phases
from services.errors import InvalidRequestError
from services.phases import ENGINE_LOOP_SECONDS, phase, profiler_range

_ids = itertools.count()
log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0005


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class AsyncEngine:
    def __init__(self, engine: Engine, role: str = "engine"):
        self.engine = engine
        self.role = role  # the role label of this engine thread's phase metrics (prefill, decode)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.steps = 0  # engine steps run so far (the hop probe counts steps to a first token: hops.py)
        # Called on the engine thread with each step's outputs, before they are delivered
        # (the decode service batches one Redis write per step from here).
        self.on_step: Callable[[list[RequestOutput]], None] | None = None
        # Requests whose stream wants only its last output (finished, or an error): on_step takes every
        # token to its destination (the decode worker's result writer), so the others would only wake the
        # event loop and pass through a queue and a generator per token for nothing.
        self.finals_only: set[str] = set()
        # Work the engine thread has done (commands run, steps): what the engine reports (stats) changes only
        # with it, so a reader that saw this count unchanged need not hop onto the thread to ask again.
        self.activity = 0
        # watch_kv_events: (loop, event) set once the engine holds KV events to take; told: set since the
        # consumer last said it was taking them (kv_events_taken), so a step that adds more does not wake it again
        self._kv_watch: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._kv_told = False
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The OS id of the engine thread (the one that computes), e.g. to pin it to a core."""
        return self._thread.native_id

    # ---- engine thread --------------------------------------------------
    def _loop(self) -> None:
        # Each iteration is timed whole (pdserve_engine_loop_seconds) and by phase: commands,
        # publish, idle here, and the step's own phases inside Engine.step; their sums tile it.
        phases.set_role(self.role)
        loop_seconds = ENGINE_LOOP_SECONDS.labels(self.role)
        while not self._stopped:
            started = time.perf_counter()
            with phase("commands"):
                self._run_commands()
            # Outputs made between steps (a decode that starts from a transferred first
            # token, an abort) go out now, not after the next forward pass: that token is
            # the request's time to first token.
            self._publish(self.engine.take_pending_outputs())
            if not self.engine.has_unfinished():
                self._tell_kv_events()
                with phase("idle"):
                    # no timeout: every way work reaches the engine (call, submit, shutdown) sets _wake, and an
                    # idle worker's engine thread then costs no wake-up at all (a 50 ms poll cost 20 a second)
                    self._wake.wait()
                    self._wake.clear()
            else:
                try:
                    with profiler_range("engine.step"):  # what `pdserve profile` counts as a worker's activity
                        outputs = self.engine.step()
                    self.steps += 1
                    self.activity += 1
                except Exception as exc:  # a bug or device failure: fail the in-flight requests, keep serving
                    log.exception("engine step failed")
                    outputs = self._fail_all(f"engine step failed: {exc}")
                self._publish(outputs)
                self._tell_kv_events()
            loop_seconds.observe(time.perf_counter() - started)
        # Commands submitted before shutdown still run: a release or abort queued just before it
        # (a transfer's owner giving back its blocks) would otherwise leave its request behind.
        self._run_commands()

    def _tell_kv_events(self) -> None:
        """Wake the KV-event consumer once events wait (at most once until it takes them): it sleeps on an
        asyncio.Event instead of asking every few ms, so an idle worker pays nothing and a decoding one a
        wake-up per filled block, not 50 a second."""
        watch = self._kv_watch
        if watch is not None and not self._kv_told and self.engine.has_kv_events():
            self._kv_told = True
            watch[0].call_soon_threadsafe(watch[1].set)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self.activity += 1  # before it runs: a command that reads ``activity`` counts itself
            try:
                command()
            except Exception:  # a fire-and-forget command (call() reports its own errors)
                log.exception("engine command failed")

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        with phase("publish"):
            self._publish_now(outputs)

    def _publish_now(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            try:
                self.on_step(outputs)
            except Exception:
                log.exception("step hook failed")
        self._deliver(outputs)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """Fail the requests a step runs (waiting or running). A reservation (its KV transfer may be
        writing into its blocks) and a prefilled request (a sender may be reading them) are left to
        their owners, who release them once no transfer touches the blocks (kvtransfer/ownership.py):
        freed here, the blocks would be handed out under the transfer, and the decode that follows
        would find no reservation."""
        outputs = []
        for request_id, req in list(self.engine.requests.items()):
            if req.status in (Status.RESERVED, Status.PREFILLED):
                continue
            self.engine.abort(request_id)
            outputs.append(RequestOutput(request_id, finished=True, finish_reason="error", error=message))
        self.engine.step_outputs_discard()
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop per step, not one per
        output (each call_soon_threadsafe writes the loop's self-pipe and makes the loop take the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        finals_only = self.finals_only
        for out in outputs:
            if finals_only and out.request_id in finals_only and not (out.finished or out.error):
                continue
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def call(self, fn: Callable[[], object]) -> "asyncio.Future":
        """Run ``fn`` on the engine thread between steps; await its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting caller
                # bind exc now: Python unbinds the except-clause name when the block ends
                loop.call_soon_threadsafe(lambda e=exc: fut.done() or fut.set_exception(e))
            else:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

        self._commands.put(run)
        self._wake.set()
        return fut

    # ---- public ---------------------------------------------------------
    def watch_kv_events(self) -> asyncio.Event:
        """An asyncio.Event (of the calling loop) that the engine thread sets when the engine has KV events to
        take. The consumer clears it and calls ``kv_events_taken`` before it takes them; events that arrive
        after that set it again."""
        event = asyncio.Event()
        self._kv_watch, self._kv_told = (asyncio.get_running_loop(), event), False
        if self.engine.has_kv_events():  # stored before the watch began: no later step would tell of them
            self._kv_told = True
            event.set()
        return event

    def kv_events_taken(self) -> None:
        """Called by the consumer just before it takes the events: the next ones set the event again."""
        self._kv_told = False

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, prefill_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream a new request's outputs; raises InvalidRequestError before the first one if it is bad."""
        rid = request_id or f"req-{next(_ids)}"

        def add() -> None:
            self.engine.add_request(rid, prompt_token_ids, params, priority, prefill_only)
            if hops.enabled():  # the hop probe only: nothing per request when it is off
                hops.mark(hops.client_id(rid), f"{self.role}.added", step=self.steps)

        stream = self.stream(rid, add)
        # close the inner stream with this one, so a consumer that stops iterating aborts now, not at GC
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    async def stream(self, request_id: str, start: Callable[[], object]) -> AsyncIterator[RequestOutput]:
        """Run ``start`` on the engine thread (it creates ``request_id``), then stream its outputs."""
        async with contextlib.aclosing(self.stream_many([request_id], start)) as outputs:
            async for out in outputs:
                yield out

    async def generate_choices(self, request_ids: list[str], prompt_token_ids: list[int],
                               params: list[SamplingParams], priority: int = 0) -> AsyncIterator[RequestOutput]:
        """``n`` choices of one prompt as one forked generation (``Engine.add_choices``): every choice's outputs,
        as they come, each naming its request id, until all have finished."""
        stream = self.stream_many(request_ids, lambda: self.engine.add_choices(request_ids, prompt_token_ids,
                                                                               params, priority))
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    async def stream_many(self, request_ids: list[str], start: Callable[[], object]) -> AsyncIterator[RequestOutput]:
        """Run ``start`` on the engine thread (it creates every one of ``request_ids``), then stream their outputs
        on one queue until each has finished; leaving early aborts those not finished."""
        q: asyncio.Queue = asyncio.Queue()
        taken = [rid for rid in request_ids if rid in self._streams]
        if taken:
            raise InvalidRequestError(f"request id {taken[0]!r} is already streaming", param="request_id")
        loop = asyncio.get_running_loop()
        for rid in request_ids:
            self._streams[rid] = (loop, q)
        added = False  # set on the engine thread once ``start`` succeeded
        running = set(request_ids)

        def run_start() -> None:
            nonlocal added
            start()
            added = True

        try:
            await self.call(run_start)
            while running:
                out = await q.get()
                if out.finished:
                    running.discard(out.request_id)
                yield out
        finally:
            for rid in request_ids:
                self._streams.pop(rid, None)
            if running:
                # Queued behind run_start (commands run in order), so a consumer that left
                # before its request was even added still aborts it; a failed start aborts nothing.
                left = list(running)
                self.submit(lambda: added and [self.engine.abort(rid) for rid in left])

    def submit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the engine thread between steps, without waiting for it."""
        self._commands.put(fn)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.submit(lambda: self.engine.abort(request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
