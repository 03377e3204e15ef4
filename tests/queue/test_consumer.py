"""The router's consumer: weighted fairness, reclaim, retry, dead letters, deadlines, idempotency."""

import asyncio
import json
import time

import pytest
from redis.exceptions import ResponseError

from services.queue import AdmissionQueue, QueueConfig, QueueConsumer, ResultWriter
from services.queue.keys import DEAD_STREAM, result_stream, tier_stream

from .conftest import make_request

GROUP = "routers"


async def pending(r, tier):
    return (await r.xpending(tier_stream(tier), GROUP))["pending"]


async def result_events(r, request_id):
    return [(f[b"type"].decode(), json.loads(f[b"data"])) for _, f in await r.xrange(result_stream(request_id))]


def test_weighted_fairness_without_starvation(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r)
        await consumer.ensure_groups()
        for _ in range(30):
            await queue.enqueue(make_request("batch"))
        for _ in range(30):
            await queue.enqueue(make_request("interactive"))
        order = []
        while deliveries := await consumer.next(count=1):
            [d] = deliveries
            order.append(d.tier)
            await consumer.ack(d)
        assert len(order) == 60
        first10 = order[:10]
        assert first10.count("interactive") >= 8 and "batch" in first10
        last_interactive = max(i for i, t in enumerate(order) if t == "interactive")
        assert order.index("batch") < last_interactive  # batch is served while interactive still waits
        assert order[:27].count("batch") == 3  # weights 8:1 while both have work (standard is empty)
        assert order[-3:] == ["batch"] * 3  # the rest drains once interactive is done

    with_redis(go)


def test_empty_higher_tiers_do_not_block_lower_ones(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r)
        await consumer.ensure_groups()
        for _ in range(8):
            await queue.enqueue(make_request("standard"))
            await queue.enqueue(make_request("batch"))
        got = await consumer.next(count=8)
        assert [d.tier for d in got].count("standard") == 6  # 3:1 with interactive empty
        got += await consumer.next(count=100)
        assert len(got) == 16
        # only batch has work: it is served at once
        await queue.enqueue(make_request("batch"))
        [d] = await consumer.next(count=4)
        assert d.tier == "batch"

    with_redis(go)


def test_blocking_next_wakes_on_a_new_entry(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r)
        await consumer.ensure_groups()
        await queue.enqueue(make_request("batch"))
        [old] = await consumer.next()
        req = make_request("standard")

        async def later():
            await asyncio.sleep(0.2)
            await queue.enqueue(req)

        task = asyncio.create_task(later())
        got = await consumer.next(count=1, block_ms=10_000)
        await task
        assert [d.request_id for d in got] == [req.request_id] and old.request_id != req.request_id
        start = time.monotonic()
        assert await consumer.next(count=1, block_ms=150) == []
        assert time.monotonic() - start >= 0.14  # it did wait

    with_redis(go)


def test_an_entry_added_while_routers_wait_goes_to_exactly_one_of_them(with_redis):
    async def go(r):
        queue = AdmissionQueue(r)
        routers = [QueueConsumer(r, consumer=f"router-{i}") for i in range(3)]
        for c in routers:
            await c.ensure_groups()
        req = make_request("interactive")

        async def later():
            await asyncio.sleep(0.2)  # every router is waiting by now
            await queue.enqueue(req)

        task = asyncio.create_task(later())
        got = await asyncio.gather(*(c.next(count=8, block_ms=1500) for c in routers))
        await task
        assert sorted(len(g) for g in got) == [0, 0, 1]
        [d] = [d for g in got for d in g]
        assert (d.request_id, d.tier, d.delivery_count) == (req.request_id, "interactive", 1)
        assert await pending(r, "interactive") == 1  # pending until acked, as any delivery
        # the waiting path still screens what it takes: an expired request is answered, not handed out
        late = make_request("batch", deadline=time.time() - 1)
        waiting = asyncio.create_task(routers[0].next(count=8, block_ms=600))
        await asyncio.sleep(0.2)
        await queue.enqueue(late)
        assert await waiting == []
        assert (await result_events(r, late.request_id))[-1][1]["code"] == "deadline_exceeded"

    with_redis(go)


def test_dead_consumer_entries_are_reclaimed(with_redis):
    async def go(r):
        queue = AdmissionQueue(r)
        dying, survivor = QueueConsumer(r, consumer="router-a"), QueueConsumer(r, consumer="router-b")
        await dying.ensure_groups()
        ids = {(await queue.enqueue(make_request(t))) for t in ("interactive", "standard", "batch")}
        taken = await dying.next(count=3)
        assert {d.entry_id for d in taken} == ids  # router-a holds all three and dies
        assert await survivor.next(count=3) == []  # XREADGROUP ">" never re-delivers
        assert await survivor.reclaim(min_idle_ms=60_000) == []  # not idle long enough yet
        await asyncio.sleep(0.05)
        reclaimed = await survivor.reclaim(min_idle_ms=20)
        assert {d.entry_id for d in reclaimed} == ids
        assert all(d.delivery_count == 2 for d in reclaimed)
        for d in reclaimed:
            await survivor.ack(d)
        for tier in ("interactive", "standard", "batch"):
            assert await pending(r, tier) == 0
        assert (await queue.depth()).requests == 0

    with_redis(go)


def test_retryable_failure_is_retried(with_redis):
    async def go(r):
        queue = AdmissionQueue(r)
        a, b = QueueConsumer(r, consumer="router-a"), QueueConsumer(r, consumer="router-b")
        req = make_request("interactive")
        await queue.enqueue(req)
        [first] = await a.next()
        assert await a.fail(first, "prefill worker unreachable", "prefill-0") == "retried"
        [second] = await b.next()  # any router's next read retries it, no reclaim wait
        assert second.request_id == req.request_id and second.delivery_count == 2
        assert second.entry_id != first.entry_id and second.request == first.request
        assert await a.fail(first, "late duplicate report", "prefill-0") == "not_owner"
        await b.ack(second)
        assert await pending(r, "interactive") == 0 and await r.xlen(tier_stream("interactive")) == 0
        assert await r.xlen(DEAD_STREAM) == 0

    with_redis(go)


def test_always_failing_request_is_dead_lettered(with_redis):
    async def go(r):
        cfg = QueueConfig(max_deliveries=3)
        queue, consumer = AdmissionQueue(r, cfg), QueueConsumer(r, consumer="router-a", config=cfg)
        req = make_request("standard", tokens=6)
        await queue.enqueue(req)
        outcomes, counts = [], []
        while deliveries := await consumer.next():
            [d] = deliveries
            counts.append(d.delivery_count)
            outcomes.append(await consumer.fail(d, f"decode crashed (try {d.delivery_count})", "decode-7"))
        assert counts == [1, 2, 3] and outcomes == ["retried", "retried", "dead_lettered"]
        [(_, fields)] = await r.xrange(DEAD_STREAM)
        f = {k.decode(): v.decode() for k, v in fields.items()}
        assert f["last_error"] == "decode crashed (try 3)" and f["worker"] == "decode-7"
        assert f["delivery_count"] == "3" and f["tier"] == "standard" and f["entry_id"] == d.entry_id
        assert f["request_id"] == req.request_id and json.loads(f["token_ids"]) == req.token_ids
        assert await pending(r, "standard") == 0 and await r.xlen(tier_stream("standard")) == 0
        assert await result_events(r, req.request_id) == [
            ("error", {"code": "internal_error", "message": "decode crashed (try 3)", "status": 500})]
        depth = await queue.depth()
        assert depth.requests == 0 and depth.prompt_tokens == 0 and depth.dead == 1
        assert (await queue.state(req.request_id))["status"] == "dead"

    with_redis(go)


def test_not_retryable_goes_straight_to_dead_letters(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r)
        req = make_request()
        await queue.enqueue(req)
        [d] = await consumer.next()
        assert await consumer.fail(d, "prompt exceeds context", "router", retryable=False,
                                   code="invalid_request_error") == "dead_lettered"
        assert await r.xlen(DEAD_STREAM) == 1 and await pending(r, "standard") == 0
        assert (await result_events(r, req.request_id))[0][1]["code"] == "invalid_request_error"

    with_redis(go)


def test_dead_letter_is_written_before_the_ack(with_redis):
    """If the dead-letter XADD fails, the entry must still be pending (nothing acked unrecorded)."""

    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r, consumer="router-a")
        await queue.enqueue(make_request("batch"))
        [d] = await consumer.next()
        await r.set(DEAD_STREAM, "not a stream")  # the XADD to the dead stream will fail
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await consumer.fail(d, "boom", "decode-1", retryable=False)
        assert await pending(r, "batch") == 1 and await r.xlen(tier_stream("batch")) == 1
        await r.delete(DEAD_STREAM)
        assert await consumer.fail(d, "boom", "decode-1", retryable=False) == "dead_lettered"
        assert await pending(r, "batch") == 0 and await r.xlen(DEAD_STREAM) == 1

    with_redis(go)


def test_poison_request_that_kills_its_consumers_is_dead_lettered_on_reclaim(with_redis):
    async def go(r):
        cfg = QueueConfig(max_deliveries=2)
        queue = AdmissionQueue(r, cfg)
        req = make_request("interactive")
        await queue.enqueue(req)
        a, b, c = (QueueConsumer(r, consumer=n, config=cfg) for n in "abc")
        assert len(await a.next()) == 1  # a dies holding it
        await asyncio.sleep(0.03)
        assert len(await b.reclaim(min_idle_ms=10)) == 1  # delivery 2; b dies too
        await asyncio.sleep(0.03)
        assert await c.reclaim(min_idle_ms=10) == []  # delivery 3 > 2: not run again
        [(_, fields)] = await r.xrange(DEAD_STREAM)
        assert b"gave up after 3 deliveries" in fields[b"last_error"]
        assert await pending(r, "interactive") == 0
        assert (await result_events(r, req.request_id))[-1][0] == "error"

    with_redis(go)


def test_expired_deadline_at_dequeue_is_an_error_not_a_delivery(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r)
        late = make_request("interactive", deadline=time.time() + 0.05)
        fine = make_request("interactive", deadline=time.time() + 3600)
        await queue.enqueue(late)
        await queue.enqueue(fine)
        await asyncio.sleep(0.1)
        got = await consumer.next(count=5)
        assert [d.request_id for d in got] == [fine.request_id]
        assert await result_events(r, late.request_id) == [
            ("error", {"code": "deadline_exceeded", "message": "deadline exceeded", "status": 504})]
        assert await pending(r, "interactive") == 1  # only `fine`, which is being worked on
        assert (await queue.state(late.request_id))["status"] == "expired"
        assert await r.xlen(DEAD_STREAM) == 0

    with_redis(go)


def test_malformed_entry_goes_to_dead_letters(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r, consumer="router-a")
        await consumer.ensure_groups()
        await r.xadd(tier_stream("batch"), {"v": "1", "request_id": "junk-1", "token_ids": "[1,"})
        good = make_request("batch")
        await queue.enqueue(good)
        got = await consumer.next(count=5)
        assert [d.request_id for d in got] == [good.request_id]
        [(_, fields)] = await r.xrange(DEAD_STREAM)
        assert fields[b"request_id"] == b"junk-1" and fields[b"token_ids"] == b"[1,"
        assert fields[b"last_error"].startswith(b"malformed queue entry: ") and fields[b"worker"] == b"router-a"
        assert (await result_events(r, "junk-1"))[0][0] == "error"
        assert await pending(r, "batch") == 1

    with_redis(go)


def test_redelivery_of_a_finished_request_is_acked_and_skipped(with_redis):
    """The decode worker wrote the final event, then the router died before acking."""

    async def go(r):
        queue = AdmissionQueue(r)
        a, b = QueueConsumer(r, consumer="a"), QueueConsumer(r, consumer="b")
        req = make_request("standard")
        await queue.enqueue(req)
        [d] = await a.next()
        await ResultWriter(r).finish(req.request_id, {"finish_reason": "stop"})
        await asyncio.sleep(0.03)
        assert await b.reclaim(min_idle_ms=10) == []  # not run twice
        assert await pending(r, "standard") == 0 and await r.xlen(tier_stream("standard")) == 0
        assert (await queue.state(req.request_id))["status"] == "done"
        assert (await queue.depth()).prompt_tokens == 0
        await a.ack(d)  # the dead router's late ack changes nothing
        assert (await queue.depth()).requests == 0

    with_redis(go)
