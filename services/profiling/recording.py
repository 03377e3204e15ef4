"""What one process records for ``Profile``: spans only (router, gateway) or torch + spans (workers)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time

from services.profiling.spans import SpanRecorder

CLOCK_MARK = "pdserve.clock_sync"


async def record_spans(seconds: float, with_stack: bool = True) -> tuple[list, int]:
    """The router's and gateway's recording: Python-level ranges for ``seconds`` (no torch: no stacks)."""
    recorder = SpanRecorder()
    recorder.start()
    try:
        await asyncio.sleep(seconds)
    finally:
        recorder.stop()
    return recorder.events, recorder.requests


class EngineProfiler:
    """A worker's recording: the torch profiler on the engine thread, plus the process's spans.

    torch's profiler records the ops of the thread that started it (others' are lost),
    so it is started and stopped between engine steps on the engine thread itself.
    Its timestamps are on the profiler's own clock; a range marked at a known
    ``time.time_ns()`` right after the start gives the shift to wall-clock time.
    """

    def __init__(self, aengine):
        self.aengine = aengine

    async def record(self, seconds: float, with_stack: bool = True) -> tuple[list, int]:
        if self.aengine is None:
            raise RuntimeError("the model is still loading; profile once the worker is ready")
        state: dict = {}
        spans = SpanRecorder()
        await self.aengine.call(lambda: _start(state, with_stack))
        spans.start()
        try:
            await asyncio.sleep(seconds)
        finally:
            spans.stop()
            await self.aengine.call(state["profiler"].stop)
        events = await asyncio.to_thread(_export, state["profiler"], state["wall_ns"])
        steps = sum(1 for e in events if e.get("name") == "engine.step" and e.get("ph") == "X")
        return events + spans.events, steps + spans.requests


def _start(state: dict, with_stack: bool) -> None:  # engine thread
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=with_stack)
    profiler.start()
    with torch.profiler.record_function(CLOCK_MARK):
        state["wall_ns"] = time.time_ns()
    state["profiler"] = profiler


def _export(profiler, wall_ns: int) -> list:
    """The profiler's events with ``ts`` moved onto the Unix wall clock (microseconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mark = next((e for e in events if e.get("name") == CLOCK_MARK and "ts" in e), None)
    if mark is None:
        raise RuntimeError("the torch profiler trace lacks its clock mark")
    shift = wall_ns / 1e3 - float(mark["ts"])
    for event in events:
        if "ts" in event:
            event["ts"] = float(event["ts"]) + shift
    return events
