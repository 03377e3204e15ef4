"""The admission queue's weighted-fair dequeue, run as the production Lua script.

``services/queue/scripts.py``'s DEQUEUE (smooth weighted round-robin over the
tiers that have undelivered entries) runs unchanged in an embedded Lua (lupa),
against in-memory tier queues that answer the two commands it calls
(``XREADGROUP ... COUNT 1 STREAMS <tier> >`` and ``XREVRANGE <tier> + - COUNT 1``)
as Redis does: an entry, or ``false`` for an empty stream. The consumer's
current weights travel between calls as ``QueueConsumer`` carries them. So the
simulator's priority order is the production script's, not a copy of it.
"""

from __future__ import annotations

from collections import deque

from services.queue.config import QueueConfig
from services.queue.keys import tier_stream
from services.queue.scripts import DEQUEUE


class SimAdmission:
    def __init__(self, config: QueueConfig | None = None):
        from lupa import LuaRuntime

        self.config = config or QueueConfig()
        self._lua = LuaRuntime(unpack_returned_tuples=True)
        self._script = self._lua.execute("return function(KEYS, ARGV, redis) " + DEQUEUE + " end")
        self._keys = [tier_stream(t) for t in self.config.tiers]
        self._queues = {k: deque() for k in self._keys}
        self._tier_of_key = dict(zip(self._keys, self.config.tiers))
        self._jobs: dict[str, object] = {}
        self._weights = [self.config.weights[t] for t in self.config.tiers]
        self._current = [0] * len(self._keys)
        self._ids = 0
        self._redis = self._lua.table_from({"call": self._call})
        self._lua_keys = self._lua.table_from(self._keys)

    def __len__(self) -> int:
        return len(self._jobs)

    def depth(self) -> dict[str, int]:
        return {t: len(self._queues[k]) for t, k in zip(self.config.tiers, self._keys)}

    def add(self, job, tier: str) -> None:
        if tier not in self.config.tiers:
            raise ValueError(f"unknown priority tier {tier!r}; tiers are {list(self.config.tiers)}")
        self._ids += 1
        entry_id = f"{self._ids}-0"
        self._jobs[entry_id] = job
        self._queues[tier_stream(tier)].append(entry_id)

    def next(self):
        """The next job in weighted-fair order, or None when every tier is empty."""
        if not self._jobs:
            return None
        args = self._lua.table_from(["routers", "sim", 1, *self._weights, *self._current])
        reply = self._script(self._lua_keys, args, self._redis)
        out, current = reply[1], reply[2]
        self._current = [int(current[i + 1]) for i in range(len(self._keys))]
        if len(out) == 0:
            return None
        return self._jobs.pop(out[1][2])

    def _call(self, command, *args):
        if command == "XREADGROUP":  # GROUP g c COUNT 1 STREAMS key >
            key = args[-2]
            queue = self._queues[key]
            if not queue:
                return False
            return self._lua.table_from([self._lua.table_from(
                [key, self._lua.table_from([self._lua.table_from([queue.popleft(), self._lua.table_from([])])])])])
        if command == "XREVRANGE":
            queue = self._queues[args[0]]
            return self._lua.table_from([self._lua.table_from([queue[-1]])] if queue else [])
        raise RuntimeError(f"the simulated queue does not serve {command}")
