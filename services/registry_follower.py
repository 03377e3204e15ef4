"""Following the worker registry: published changes as they come, the whole registry now and then.

Workers publish each heartbeat's entry, and their deregistration, on
``CHANGES_CHANNEL`` (registry.py). A follower hands what arrives to ``apply``
(worker id -> its entry, or None for one that left) in batches, at most once per
``batch_s``, and reads the whole registry every ``reread_s`` (``read``): entries
that expired (workers that died without deregistering) and any message a
dropped subscription missed. Re-reading every 250 ms cost an idle router and an
idle gateway 8-10 Redis round trips a second each; following costs a message per
heartbeat and one read a second.

One task does both, so a change received after a read began is applied after
that read: a read never undoes a newer change. The first read comes after
subscribing, so nothing between the two is missed. ``healthy`` says whether the
last read succeeded within ``2 * reread_s`` (a caller falls back to reading for
itself when not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable

from services.registry import CHANGES_CHANNEL, WorkerInfo, parse_change

log = logging.getLogger(__name__)


class RegistryFollower:
    def __init__(self, redis, read: Callable[[], Awaitable[None]],
                 apply: Callable[[dict[str, WorkerInfo | None]], None], batch_s: float, reread_s: float,
                 stopping: Callable[[], bool] = lambda: False):
        if batch_s <= 0 or reread_s <= 0:
            raise ValueError(f"batch_s and reread_s must be positive, got {batch_s} and {reread_s}")
        self.redis = redis
        self.read, self.apply = read, apply
        self.batch_s, self.reread_s = batch_s, reread_s
        self._stopping = stopping
        self._stopped = False
        self.read_at = -float("inf")  # monotonic time of the last whole read that succeeded

    def stopping(self) -> bool:
        return self._stopped or self._stopping()

    def stop(self) -> None:
        """Ends ``run`` after its current read even if a cancel was swallowed (redis-py #2028, loops.py)."""
        self._stopped = True

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self.read_at < 2 * self.reread_s

    async def run(self) -> None:
        """Until cancelled or ``stopping()``; a failure (Redis away) subscribes and reads again, backing off."""
        backoff = 0.1
        while not self.stopping():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CHANGES_CHANNEL)
                await self._follow(pubsub)
            except Exception as exc:  # the caller keeps what it knew meanwhile
                log.warning("following the worker registry failed: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.reread_s)
            else:
                backoff = 0.1
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _follow(self, pubsub) -> None:
        pending: dict[str, WorkerInfo | None] = {}
        applied_at = reread_at = -float("inf")
        while not self.stopping():
            now = time.monotonic()
            if now >= reread_at:
                await self.read()
                self.read_at = now
                pending.clear()  # received before the read was sent: the read is as new
                reread_at = now + self.reread_s
            elif pending and now >= applied_at + self.batch_s:
                self.apply(pending)
                pending, applied_at = {}, now
            wait = reread_at - now
            if pending:
                wait = min(wait, applied_at + self.batch_s - now)
            message = await pubsub.get_message(timeout=max(wait, 0.0))
            if message is not None and message.get("type") == "message":
                try:
                    worker_id, info = parse_change(message["data"])
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("ignored a malformed registry change: %s", exc)
                    continue
                pending[worker_id] = info
