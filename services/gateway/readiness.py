"""Which decode workers are ready, from the registry: readiness (503 when none) and the context length.

The registry is read at most once per ``cache_s``. A decode worker counts when
it is registered (its heartbeat key has not expired), ready (model loaded) and
not draining.
"""

from __future__ import annotations

import asyncio
import time

from services.errors import NoWorkerError
from services.registry import WorkerInfo, read_workers


class DecodeWorkers:
    def __init__(self, redis, retry_after_s: float, cache_s: float = 0.25):
        self.redis = redis
        self.retry_after_s = retry_after_s
        self.cache_s = cache_s
        self._ready: list[WorkerInfo] = []
        self._read_at = -1e9
        self._lock = asyncio.Lock()

    async def ready(self) -> list[WorkerInfo]:
        if time.monotonic() - self._read_at < self.cache_s:
            return self._ready
        async with self._lock:
            if time.monotonic() - self._read_at >= self.cache_s:
                workers = await read_workers(self.redis)
                self._ready = [w for w in workers if w.role == "decode" and w.ready and not w.draining]
                self._read_at = time.monotonic()
            return self._ready

    async def check(self) -> None:
        """Raise ``NoWorkerError`` (503, ``retry_after_s``) when no decode worker could take a request."""
        if not await self.ready():
            exc = NoWorkerError(f"no decode worker is ready; retry after {self.retry_after_s:g} s")
            exc.retry_after_s = self.retry_after_s
            raise exc

    async def max_model_len(self) -> int | None:
        """The smallest context length the ready decode workers serve (None when none says)."""
        lengths = [w.max_model_len for w in await self.ready() if w.max_model_len > 0]
        return min(lengths) if lengths else None
