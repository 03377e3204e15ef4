"""The virtual clock: a heap of timed callbacks, run in (time, insertion) order.

Ties run in the order they were scheduled, so a run is a pure function of its
inputs and seed (the simulator's determinism rests on this and on every random
draw coming from seeded ``random.Random`` instances).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


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
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            self.events_run += 1
        self.now = max(self.now, min(until, self.now if not heap else heap[0][0]))

    def __len__(self) -> int:
        return len(self._heap)
