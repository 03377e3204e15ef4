"""Workers of one role kept in order of a key of their load, so a policy reads the best first.

A policy's choice is "the least loaded worker that fits": scanning every worker's load
per request is linear in the workers, most of the router's time at hundreds of them
(``pdserve bench sim`` at 1,000 workers: half of kv-aware's time). The pool keeps one
``LoadRanking`` per (role, key) a policy asked for and re-keys a worker when its load
changes (its heartbeat, a request begun or ended there), so a choice reads the few
workers at the head of the order instead of all of them.

A binary heap with lazy deletion: re-keying pushes a new entry and leaves the old one
behind, marked stale by a sequence number; the heap is rebuilt when stale entries
outnumber live ones, and stale entries at its top are popped before each read. ``ordered()`` walks the heap in key order without popping
(a frontier of heap positions, O(k log k) for the first k workers), so a choice
leaves nothing to put back. Ties go to the lower worker id, as the linear scans did.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, KeysView
from typing import Any


class LoadRanking:
    def __init__(self, key: Callable[[Any], Hashable]):
        self.key = key  # WorkerLoad -> a comparable; lower is preferred
        self._heap: list[tuple[Any, str, int]] = []  # (key, worker id, sequence)
        self._live: dict[str, tuple[Any, int]] = {}  # worker id -> its current (key, sequence)
        self._seq = itertools.count()

    def members(self) -> KeysView[str]:
        return self._live.keys()

    def key_of(self, worker_id: str):
        """A member's current key (KeyError for a non-member)."""
        return self._live[worker_id][0]

    def set(self, worker_id: str, load) -> None:
        """Rank ``worker_id`` by ``load`` from now on (it joins the ranking if new)."""
        key, seq = self.key(load), next(self._seq)
        self._live[worker_id] = (key, seq)
        heapq.heappush(self._heap, (key, worker_id, seq))
        if len(self._heap) > 2 * len(self._live) + 32:  # mostly stale: rebuild from the live entries
            self._heap = [(k, w, s) for w, (k, s) in self._live.items()]
            heapq.heapify(self._heap)

    def ordered(self) -> Iterator[tuple[Any, str]]:
        """(key, worker id) of every member, lowest key first (then lowest id). Do not ``set`` while
        iterating: the walk reads the heap in place."""
        heap, live = self._heap, self._live
        while heap:  # re-keyed workers leave their old, lower keys at the top: drop those first
            key, worker_id, seq = heap[0]
            current = live.get(worker_id)
            if current is not None and current[1] == seq:
                break
            heapq.heappop(heap)
        n = len(heap)
        if not n:
            return
        frontier = [(heap[0], 0)]  # entries are unique by sequence, so positions are never compared
        pop, push = heapq.heappop, heapq.heappush
        while frontier:
            entry, i = pop(frontier)
            key, worker_id, seq = entry
            current = live.get(worker_id)
            if current is not None and current[1] == seq:
                yield key, worker_id
            child = 2 * i + 1
            if child < n:
                push(frontier, (heap[child], child))
                if child + 1 < n:
                    push(frontier, (heap[child + 1], child + 1))
