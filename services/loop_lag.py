"""How late an asyncio event loop runs what is due: a ticker that sleeps ``interval_s`` and notes the overshoot.

    lag = LoopLag(interval_s=0.005).start()      # in the loop to watch
    ...
    lag.stop(); lag.samples                      # [(unix time of the tick, ms late), ...]

Every callback the loop runs delays everything else ready at that moment: a
tick that wakes 40 ms late means some chunk waiting for the loop waited up to
40 ms too. The garbage collector's pauses are noted beside (``gc_pauses``:
start time, generation, ms) since they stop the loop without being a callback
of it. Used by the gateway's fan-out probe (fanout_probe.py) and by the load
generator of ``pdserve bench frontdoor`` (so the client side of a per-chunk
comparison says how late it read).
"""

from __future__ import annotations

import asyncio
import gc
import time


class LoopLag:
    def __init__(self, interval_s: float = 0.005, keep: int = 2_000_000):
        self.interval_s = interval_s
        self.keep = keep  # samples kept at most (an hour of 5 ms ticks is 720,000)
        self.samples: list[tuple[float, float]] = []
        self.gc_pauses: list[tuple[float, int, float]] = []
        self._task: asyncio.Task | None = None
        self._gc_started: tuple[float, float] | None = None

    def start(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-lag")
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            late = loop.time() - due
            if len(self.samples) < self.keep:
                self.samples.append((time.time(), late * 1e3))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = (time.time(), time.perf_counter())
        elif self._gc_started is not None and len(self.gc_pauses) < self.keep:
            wall, began = self._gc_started
            self.gc_pauses.append((wall, info.get("generation", -1), (time.perf_counter() - began) * 1e3))
            self._gc_started = None
