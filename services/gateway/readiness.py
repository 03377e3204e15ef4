"""Which decode workers are ready, from the registry: readiness (503 when none) and the context length.

Once ``keep_fresh`` runs, the view follows the registry (registry_follower.py):
the entries workers publish, applied at most once per ``cache_s``, and a whole
read (two round trips) a second for entries that expired, where it read the
registry every 200 ms. Before that, or while following fails (Redis away), the
registry is read at most once per ``cache_s`` by the requests that ask
(cached_read.py). A decode worker counts when it is registered (its heartbeat
key has not expired), ready (model loaded) and not draining.
"""

from __future__ import annotations

from services.errors import NoWorkerError
from services.gateway.cached_read import CachedRead
from services.registry import WorkerInfo, read_workers
from services.registry_follower import RegistryFollower

REREAD_S = 1.0  # the whole registry, while following: how late an expired entry (a dead worker) leaves


class DecodeWorkers:
    def __init__(self, redis, retry_after_s: float, cache_s: float = 0.25):
        self.redis = redis
        self.retry_after_s = retry_after_s
        self._cache = CachedRead(self._read, cache_s)
        self._known: dict[str, WorkerInfo] = {}  # what following the registry saw: every worker by id
        self._ready: list[WorkerInfo] = []
        self._follower = RegistryFollower(redis, self._read_all, self._apply, cache_s, REREAD_S) if cache_s else None

    async def _read(self) -> list[WorkerInfo]:
        return _usable(await read_workers(self.redis))

    async def _read_all(self) -> None:
        self._known = {w.worker_id: w for w in await read_workers(self.redis)}
        self._ready = _usable(self._known.values())

    def _apply(self, changes: dict[str, WorkerInfo | None]) -> None:
        for worker_id, info in changes.items():
            if info is None:
                self._known.pop(worker_id, None)
            else:
                self._known[worker_id] = info
        self._ready = _usable(self._known.values())

    @property
    def following(self) -> bool:
        """Answering from what it follows (no read on a request's path)."""
        return self._follower is not None and self._follower.healthy

    async def ready(self) -> list[WorkerInfo]:
        if self.following:
            return self._ready
        return await self._cache.get()

    async def keep_fresh(self) -> None:
        """Follow the registry until cancelled; returns at once for ``cache_s == 0`` (every request reads)."""
        if self._follower is not None:
            await self._follower.run()

    def stop(self) -> None:
        """``keep_fresh`` ends even if the cancel that follows is swallowed."""
        if self._follower is not None:
            self._follower.stop()

    async def check(self) -> None:
        """Raise ``NoWorkerError`` (503, ``retry_after_s``) when no decode worker could take a request."""
        if not await self.ready():
            exc = NoWorkerError(f"no decode worker is ready; retry after {self.retry_after_s:g} s")
            exc.retry_after_s = self.retry_after_s
            raise exc

    async def max_model_len(self, model: str = "") -> int | None:
        """The smallest context length the ready decode workers of ``model`` ("": any) serve (None when none
        says)."""
        lengths = [w.max_model_len for w in await self.ready() if w.max_model_len > 0 and model in ("", w.model)]
        return min(lengths) if lengths else None


def _usable(workers) -> list[WorkerInfo]:
    return sorted((w for w in workers if w.role == "decode" and w.ready and not w.draining), key=lambda w: w.worker_id)
