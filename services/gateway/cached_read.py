"""A Redis read every request needs (the worker list, the queue depth), shared and kept fresh off the request path.

``get`` returns the last value while it is younger than ``max_age_s`` and
otherwise reads it again, once for however many requests are waiting. Without
``keep_fresh`` a request that finds the value stale pays that read (one or two
Redis round trips) before it is queued, and at a steady rate of a few requests
per second every request does. ``keep_fresh`` (started by
``GatewayCore.start``) re-reads in the background a little more often than
``max_age_s``, so ``get`` answers from memory and the value is never older than
it was before; when the background read falls behind (Redis slow or away) a
request reads for itself, as without it.

``serve_stale`` is for a value that is only a hint (the queue depth: the
enqueue script checks the same limits atomically): ``get`` answers a stale
value at once and reads again in the background, one read at a time, and
nothing reads while nobody asks. An idle gateway then costs Redis nothing and a
request one read at most, instead of a read every ``max_age_s`` whatever the
traffic. A background read that failed is not hidden: the next ``get`` reads
for itself (and raises). A caller about to act on a stale value in a way that
must be current asks ``current`` (a refusal: the queue may have drained).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# the background read runs this fraction of max_age_s after the previous one finished, so the
# value is re-read before a request could find it stale even when a read takes a while
_REFRESH_FRACTION = 0.8


class CachedRead(Generic[T]):
    def __init__(self, read: Callable[[], Awaitable[T]], max_age_s: float, serve_stale: bool = False):
        if max_age_s < 0:
            raise ValueError("max_age_s must be >= 0")
        self._read = read
        self.max_age_s = max_age_s
        self.serve_stale = serve_stale
        self._value: T | None = None
        self._read_at = -1e18  # monotonic time the value was read at
        self._lock = asyncio.Lock()
        self._revalidating: asyncio.Task | None = None  # serve_stale's background read
        self._stale_failed = False  # that read failed: the next get reads for itself

    def _fresh(self) -> bool:
        return self._value is not None and time.monotonic() - self._read_at < self.max_age_s

    async def get(self) -> T:
        if self._fresh():
            return self._value
        if self.serve_stale and self._value is not None and not self._stale_failed:
            if self._revalidating is None:
                self._revalidating = asyncio.get_running_loop().create_task(self._revalidate())
            return self._value
        return await self.current()

    async def current(self) -> T:
        """The value, read now unless it is younger than ``max_age_s`` (``serve_stale`` or not)."""
        if self._fresh():
            return self._value
        async with self._lock:  # one read, however many requests wait for it
            if not self._fresh():
                await self._refresh()
            return self._value

    def invalidate(self) -> None:
        """The next ``get`` reads again (after a write this process made)."""
        self._read_at = -1e18

    async def _refresh(self) -> None:
        started = time.monotonic()  # the value is as old as the moment it was asked for
        self._value = await self._read()
        self._read_at = started
        self._stale_failed = False

    async def _revalidate(self) -> None:
        try:
            async with self._lock:
                if not self._fresh():
                    await self._refresh()
        except Exception as exc:  # Redis away: the next request reads for itself and sees it
            log.debug("background read failed: %s", exc)
            self._stale_failed = True
        finally:
            self._revalidating = None

    async def keep_fresh(self) -> None:
        """Re-read every ``max_age_s * 0.8`` until cancelled; returns at once for ``max_age_s == 0`` (no cache)."""
        if self.max_age_s <= 0:
            return
        while True:
            try:
                async with self._lock:
                    await self._refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: requests read (and fail) for themselves meanwhile
                log.debug("background read failed: %s", exc)
            await asyncio.sleep(self.max_age_s * _REFRESH_FRACTION)
