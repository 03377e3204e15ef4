"""Which decode workers are ready, from the registry: readiness (503 when none) and the context length.

The registry is read at most once per ``cache_s`` (two round trips), in the
background once ``keep_fresh`` runs (cached_read.py). A decode worker counts
when it is registered (its heartbeat key has not expired), ready (model loaded)
and not draining.
"""

from __future__ import annotations

from services.errors import NoWorkerError
from services.gateway.cached_read import CachedRead
from services.registry import WorkerInfo, read_workers


class DecodeWorkers:
    def __init__(self, redis, retry_after_s: float, cache_s: float = 0.25):
        self.redis = redis
        self.retry_after_s = retry_after_s
        self._cache = CachedRead(self._read, cache_s)

    async def _read(self) -> list[WorkerInfo]:
        workers = await read_workers(self.redis)
        return [w for w in workers if w.role == "decode" and w.ready and not w.draining]

    async def ready(self) -> list[WorkerInfo]:
        return await self._cache.get()

    async def keep_fresh(self) -> None:
        await self._cache.keep_fresh()

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
