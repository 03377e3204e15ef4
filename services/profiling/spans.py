"""Python-level ranges of one process while it is being profiled, as Chrome trace events.

Three sources, all in wall-clock microseconds (``time.time_ns``), so a process's
ranges line up with the others' once clocks are aligned (services/profiling/merge.py):

- OpenTelemetry spans that end while recording, or start while recording and are
  still open at its end (cut there, ``open_at_stop``): gateway admission, router
  dispatch, worker RPCs, KV transfer, each with its ``trace_id``, the id that follows
  one request across processes (W3C trace context in queue messages and gRPC metadata).
- asyncio tasks created while recording (name, creation to completion).
- Redis commands and pipelines of redis-py's asyncio client.

Nothing is hooked until a recording starts, and every hook is removed when it stops,
so a process with profiling enabled but not recording runs exactly today's code
(one flag check per ended span once the first recording has installed the processor).
Overlapping ranges (concurrent requests) are async events (``ph`` b/e), which
Perfetto lays out on separate tracks instead of mis-nesting them.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from services import telemetry

_ids = itertools.count(1)


def async_range(events: list, cat: str, name: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
    """Append one range as a begin/end pair of async events (ids unique within the process)."""
    ident = f"0x{next(_ids):x}"
    base = {"cat": cat, "name": name, "id": ident, "pid": os.getpid(), "tid": threading.get_native_id()}
    events.append({**base, "ph": "b", "ts": start_ns / 1e3, "args": args or {}})
    events.append({**base, "ph": "e", "ts": end_ns / 1e3})


class _SpanSink(SpanProcessor):
    """Installed once on this process's TracerProvider (the SDK cannot remove a processor)."""

    def __init__(self) -> None:
        self.recorder: SpanRecorder | None = None

    def on_start(self, span, parent_context=None) -> None:
        recorder = self.recorder
        if recorder is not None:
            recorder.open_span(span)

    def on_end(self, span: ReadableSpan) -> None:
        recorder = self.recorder
        if recorder is not None and span.start_time is not None and span.end_time is not None:
            recorder.end_span(span, span.end_time)


_sink: _SpanSink | None = None
_sink_lock = threading.Lock()


def _span_sink() -> _SpanSink:
    global _sink
    with _sink_lock:
        if _sink is None:
            _sink = _SpanSink()
            telemetry.setup_tracing(f"pdserve-{os.getpid()}").add_span_processor(_sink)
        return _sink


class SpanRecorder:
    """Collects the ranges above between ``start`` and ``stop``; one recording at a time per process."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.requests = 0  # spans of requests seen: the process's activity
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._old_factory = None
        self._patched: list[tuple[type, str, object]] = []
        self._open: dict[int, object] = {}  # spans started while recording and not ended yet

    def open_span(self, span) -> None:
        with self._lock:
            self._open[span.get_span_context().span_id] = span

    def end_span(self, span: ReadableSpan, end_ns: int, still_open: bool = False) -> None:
        """A span as a range with its trace id; a span of one request (it names its id) is activity,
        /metrics scrapes and health checks are not."""
        ctx = span.get_span_context()
        with self._lock:
            self._open.pop(ctx.span_id, None)
        args = {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}
        args.update({k: v for k, v in (span.attributes or {}).items() if isinstance(v, (str, int, float, bool))})
        if still_open:
            args["open_at_stop"] = True
        self.add("span", span.name, span.start_time, end_ns, args, request="request_id" in args)

    def add(self, cat: str, name: str, start_ns: int, end_ns: int, args: dict | None = None,
            request: bool = False) -> None:
        with self._lock:  # spans end on the engine thread and the loop alike
            async_range(self.events, cat, name, start_ns, end_ns, args)
            self.requests += request

    def start(self) -> None:
        """Hook the span sink, this loop's task factory and the Redis client; call on the event loop."""
        _span_sink().recorder = self
        self._loop = asyncio.get_running_loop()
        self._old_factory = self._loop.get_task_factory()
        self._loop.set_task_factory(self._task_factory)
        self._patch_redis()

    def stop(self) -> None:
        if _sink is not None and _sink.recorder is self:
            _sink.recorder = None
        # A request still running at the end shows up to the end of the window, marked open.
        now = time.time_ns()
        with self._lock:
            still_open = list(self._open.values())
        for span in still_open:
            self.end_span(span, now, still_open=True)
        if self._loop is not None:
            self._loop.set_task_factory(self._old_factory)
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched.clear()

    def _task_factory(self, loop, coro, **kwargs):
        task = (self._old_factory(loop, coro, **kwargs) if self._old_factory
                else asyncio.Task(coro, loop=loop, **kwargs))
        created = time.time_ns()
        task.add_done_callback(lambda t: self.add("asyncio", f"task {t.get_name()}", created, time.time_ns()))
        return task

    def _patch_redis(self) -> None:
        """Wrap redis-py's asyncio command and pipeline entry points (restored by ``stop``)."""
        try:
            from redis.asyncio.client import Pipeline, Redis
        except ImportError:  # a process without Redis has no Redis calls to show
            return
        recorder = self

        def wrap(owner: type, attr: str, name_of) -> None:
            original = owner.__dict__[attr]

            async def timed(self, *args, **kwargs):
                started = time.time_ns()
                try:
                    return await original(self, *args, **kwargs)
                finally:
                    recorder.add("redis", name_of(self, args), started, time.time_ns())

            setattr(owner, attr, timed)
            self._patched.append((owner, attr, original))

        wrap(Redis, "execute_command", lambda _self, args: f"redis {args[0] if args else '?'}")
        wrap(Pipeline, "execute", lambda pipe, _args: f"redis pipeline ({len(pipe.command_stack)} commands)")
