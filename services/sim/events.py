"""The virtual clock: a heap of timed callbacks, run in (time, insertion) order.

Ties run in the order they were scheduled, so a run is a pure function of its
inputs and seed (the simulator's determinism rests on this and on every random
draw coming from seeded ``random.Random`` instances).

A run keeps the cyclic garbage collector off (``collector_paused``), as does building a day. The
simulator makes no reference cycles as it runs (``tests/sim/test_simulator.py`` checks), so
reference counting frees everything it drops; the collector only walked the day's live objects
(2.24M on a rate-32 day before it runs: its requests and their block-hash lists) over and over,
31% of such a day's CPU (``benchmarks/probes/sim_gc_cost.py``).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (building or running a simulated day), then as it was.

    Every object alive when the block ends moves to the collector's permanent generation (``gc.freeze``;
    what the process held before it too): a day's requests and results live on after it, and the first
    collection after the pause would otherwise walk them all, and every full collection after that again.
    Reference counting frees them as before; a cycle among them is never collected (the simulator makes none)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.events_run = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def clock(self) -> float:
        return self.now

    def run(self, until: float = float("inf")) -> None:
        heap, pop = self._heap, heapq.heappop
        with collector_paused():
            while heap and heap[0][0] <= until:
                t, _, fn, args = pop(heap)
                self.now = t
                fn(*args)
                self.events_run += 1
        self.now = max(self.now, min(until, self.now if not heap else heap[0][0]))

    def __len__(self) -> int:
        return len(self._heap)
