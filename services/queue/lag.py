"""Queue lag per tier: requests no router has taken yet, and how long the oldest has waited.

``pdserve_queue_depth`` (the gateway's) counts every unfinished request, running ones
included. Lag is the part waiting for a router: the entries after the consumer
group's last-delivered id, which is what KEDA's ``redis-streams`` trigger reads
(``lagCount``: XINFO GROUPS ``lag``) to scale the prefill tier, and the oldest of them
says how long a request waits before any work starts (the alert on queue lag).

Entries are deleted when their request is final, so XLEN = undelivered + pending;
XINFO's ``lag`` is used when Redis can say it and XLEN - pending otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from services import telemetry
from services.loops import Loops
from services.queue.config import QueueConfig
from services.queue.keys import tier_stream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierLag:
    lag: int  # entries not yet delivered to a router
    pending: int  # delivered, not yet final
    oldest_s: float  # age of the oldest undelivered entry (0 with none)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_lag(redis, config: QueueConfig, group: str = "routers", now: float | None = None) -> dict[str, TierLag]:
    now = time.time() if now is None else now
    out = {}
    for tier in config.tiers:
        stream = tier_stream(tier)
        try:
            groups = await redis.xinfo_groups(stream)
        except Exception as exc:  # no stream yet (nothing ever queued in this tier)
            if "no such key" not in str(exc).lower():
                raise
            groups = []
        info = next((g for g in groups if _text(g["name"]) == group), None)
        if info is None:
            out[tier] = TierLag(await redis.xlen(stream), 0, 0.0)  # no router ever read: all of it waits
            last = "-"
        else:
            pending = int(info["pending"])
            lag = info.get("lag")
            lag = int(lag) if lag is not None else max(0, await redis.xlen(stream) - pending)
            last = "(" + _text(info["last-delivered-id"])
            out[tier] = TierLag(lag, pending, 0.0)
        if out[tier].lag:
            first = await redis.xrange(stream, min=last, max="+", count=1)
            if first:
                ms = int(_text(first[0][0]).split("-")[0])
                out[tier] = TierLag(out[tier].lag, out[tier].pending, max(0.0, now - ms / 1e3))
    return out


class LagMonitor:
    """Reads the lag every ``interval_s`` into ``pdserve_queue_lag`` / ``pdserve_queue_lag_seconds``."""

    def __init__(self, redis, config: QueueConfig, interval_s: float = 1.0):
        self.redis, self.config, self.interval_s = redis, config, interval_s
        self._loops = Loops()

    async def update(self) -> dict[str, TierLag]:
        lags = await read_lag(self.redis, self.config)
        for tier, lag in lags.items():
            telemetry.QUEUE_LAG.labels(tier).set(lag.lag)
            telemetry.QUEUE_LAG_SECONDS.labels(tier).set(lag.oldest_s)
        return lags

    async def _run(self) -> None:
        while not self._loops.stopping:
            try:
                await self.update()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away for a moment: the gauges keep their last value
                log.warning("reading the queue lag failed: %s", exc)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._loops.start({"queue-lag": self._run})

    async def stop(self) -> None:
        await self._loops.stop(self.interval_s + 0.5)
