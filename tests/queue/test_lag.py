"""Queue lag per tier on a real Redis-compatible server: undelivered entries and the oldest one's age."""

from __future__ import annotations

import time

from services import telemetry
from services.queue import AdmissionQueue, QueueConfig, QueueConsumer
from services.queue.lag import LagMonitor, read_lag
from services.queue.message import QueuedRequest


def _request(i: int, tier: str) -> QueuedRequest:
    return QueuedRequest(request_id=f"lag-{i}", tenant="t", tier=tier, model="m", token_ids=[1, 2, 3])


def test_lag_counts_what_no_router_took_and_ages_the_oldest(with_redis):
    async def go(r):
        config = QueueConfig()
        assert {t: lag.lag for t, lag in (await read_lag(r, config)).items()} == \
            {"interactive": 0, "standard": 0, "batch": 0}  # nothing ever queued: no streams yet
        queue = AdmissionQueue(r, config)
        for i in range(3):
            await queue.enqueue(_request(i, "standard"))
        await queue.enqueue(_request(9, "batch"))
        first = await read_lag(r, config)  # no router has read yet
        assert (first["standard"].lag, first["batch"].lag, first["interactive"].lag) == (3, 1, 0)

        consumer = QueueConsumer(r, config=config)
        await consumer.ensure_groups()
        taken = await consumer.next(count=2)
        later = await read_lag(r, config, now=time.time() + 5)
        delivered = sum(1 for d in taken if d.tier == "standard")
        assert later["standard"].lag == 3 - delivered and later["standard"].pending == delivered
        assert later["standard"].oldest_s >= 5  # the oldest waiting entry, by its stream id's time
        assert later["standard"].lag + later["batch"].lag == 2
        for d in taken:
            await consumer.ack(d)  # final: entries leave the stream
        after = await read_lag(r, config)
        assert after["standard"].pending == 0 and after["standard"].lag == 3 - delivered

        monitor = LagMonitor(r, config)
        await monitor.update()
        assert telemetry.QUEUE_LAG.labels("standard")._value.get() == 3 - delivered
        assert telemetry.QUEUE_LAG_SECONDS.labels("interactive")._value.get() == 0

    with_redis(go)
