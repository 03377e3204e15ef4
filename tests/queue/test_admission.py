"""Admission: enqueue once per request id, refuse when full, and never lose what was accepted."""

import asyncio
import dataclasses

import pytest

from services.errors import CapacityError, InvalidRequestError
from services.queue import AdmissionQueue, QueueConfig, QueueConsumer
from services.queue.admission import Claim
from services.queue.keys import tier_stream

from .conftest import make_request


def test_round_trip_preserves_every_field(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r, consumer="router-a")
        await consumer.ensure_groups()
        sent = make_request("interactive", tokens=9, deadline=4102444800.0, traceparent="00-abc-def-01",
                            sampling={"temperature": 0.5, "top_p": 0.9, "stop": ["</s>"], "logprobs": 2})
        entry_id = await queue.enqueue(sent)
        [got] = await consumer.next()
        assert got.entry_id == entry_id and got.tier == "interactive" and got.delivery_count == 1
        assert dataclasses.asdict(got.request) == dataclasses.asdict(sent)
        assert got.request.prompt_tokens == 9
        await consumer.ack(got)
        assert (await queue.depth()).requests == 0

    with_redis(go)


def test_enqueue_is_idempotent_on_request_id(with_redis):
    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r)
        req = make_request("batch", tokens=5)
        first = await queue.enqueue(req)
        again = await queue.admit(dataclasses.replace(req, token_ids=[1]))  # a retried POST, same id
        assert again.entry_id == first and again.duplicate
        assert await r.xlen(tier_stream("batch")) == 1
        depth = await queue.depth()
        assert depth.tiers["batch"].requests == 1 and depth.tiers["batch"].prompt_tokens == 5
        [d] = await consumer.next(count=5)
        await consumer.ack(d)
        # still known after it finished: a late retry attaches to the original, nothing is re-run
        assert await queue.enqueue(req) == first
        assert await consumer.next(count=5) == []
        assert (await queue.state(req.request_id))["status"] == "done"

    with_redis(go)


def test_request_bound_raises_capacity_error_with_retry_after(with_redis):
    async def go(r):
        cfg = QueueConfig(max_queued_requests=3, retry_after_s=2.5)
        queue = AdmissionQueue(r, cfg)
        accepted = [make_request(t) for t in ("interactive", "standard", "batch")]
        for req in accepted:
            await queue.enqueue(req)
        with pytest.raises(CapacityError, match="queue is full") as info:
            await queue.enqueue(make_request("interactive"))
        assert info.value.retry_after_s == 2.5 and info.value.http_status == 429
        # a duplicate of an accepted request is not refused: it was admitted already
        assert await queue.enqueue(accepted[0]) is not None
        consumer = QueueConsumer(r, config=cfg)
        [d] = await consumer.next()
        await consumer.ack(d)
        await queue.enqueue(make_request("batch"))  # room again
        assert (await queue.depth()).requests == 3

    with_redis(go)


def test_prompt_token_bound(with_redis):
    async def go(r):
        cfg = QueueConfig(max_queued_prompt_tokens=20)
        queue, consumer = AdmissionQueue(r, cfg), QueueConsumer(r, config=cfg)
        await queue.enqueue(make_request(tokens=8))
        await queue.enqueue(make_request(tokens=8))
        with pytest.raises(CapacityError, match="tokens") as info:
            await queue.enqueue(make_request(tokens=8))
        assert info.value.retry_after_s == cfg.retry_after_s
        assert (await queue.depth()).prompt_tokens == 16
        [d] = await consumer.next()
        await consumer.ack(d)
        assert (await queue.depth()).prompt_tokens == 8
        await queue.enqueue(make_request(tokens=8))
        with pytest.raises(InvalidRequestError, match="at most 20"):  # could never fit: not a 429
            await queue.enqueue(make_request(tokens=21))
        with pytest.raises(InvalidRequestError, match="unknown priority tier"):
            await queue.enqueue(make_request(tier="gold"))

    with_redis(go)


def test_overload_never_loses_an_accepted_request(with_redis):
    """A burst beyond the bound while a router works: every accepted request ends acked or dead."""

    async def go(r):
        cfg = QueueConfig(max_queued_requests=8, max_deliveries=2)
        queue, consumer = AdmissionQueue(r, cfg), QueueConsumer(r, consumer="router", config=cfg)
        await consumer.ensure_groups()
        accepted, refused, acked, dead = set(), 0, set(), set()

        async def burst():
            nonlocal refused
            for i in range(20):
                req = make_request(("interactive", "standard", "batch")[i % 3])
                try:
                    await queue.enqueue(req)
                    accepted.add(req.request_id)
                except CapacityError:
                    refused += 1

        async def route():
            while len(acked) + len(dead) < len(accepted) or not done.is_set():
                await asyncio.sleep(0.01)  # slower than the burst: the queue fills up
                for d in await consumer.next(count=3, block_ms=20):
                    if int(d.request_id.split("-")[1]) % 5 == 0:  # this one always fails
                        if await consumer.fail(d, "worker exploded", "decode-0") == "dead_lettered":
                            dead.add(d.request_id)
                    else:
                        await consumer.ack(d)
                        acked.add(d.request_id)

        done = asyncio.Event()
        router = asyncio.create_task(route())
        await burst()
        await asyncio.sleep(0.15)  # the router drains some, a second burst refills
        await burst()
        done.set()
        await router
        assert refused > 0 and len(accepted) > 8
        assert acked | dead == accepted and not acked & dead
        assert await r.xlen("pd:{q}:dead") == len(dead)
        depth = await queue.depth()
        assert depth.requests == 0 and depth.prompt_tokens == 0 and depth.dead == len(dead)

    with_redis(go)


def test_a_coalescing_claim_is_made_with_the_enqueue_and_only_when_it_queues(with_redis):
    """The gateway's coalescing key is claimed by the enqueue script itself (one round trip for a leader):
    a free key is claimed and the request queued together; a held key queues nothing and names its
    holder; a full queue claims nothing, so no twin would follow a request that was never queued."""
    async def go(r):
        queue = AdmissionQueue(r, QueueConfig(max_queued_requests=2))
        key = "pd:{q}:co:test"
        lead, twin = make_request("interactive"), make_request("interactive")
        admitted = await queue.admit(lead, claim=Claim(key, f"{lead.request_id}|1", 60_000))
        assert admitted.claimed_by is None and admitted.entry_id
        assert (await r.get(key)).decode() == f"{lead.request_id}|1" and 0 < await r.pttl(key) <= 60_000
        held = await queue.admit(twin, claim=Claim(key, f"{twin.request_id}|1", 60_000))
        assert held.claimed_by == f"{lead.request_id}|1" and not held.entry_id
        assert await r.xlen(tier_stream("interactive")) == 1 and await queue.state(twin.request_id) is None
        await queue.enqueue(make_request("batch"))  # the queue is full now
        other = make_request("interactive")
        with pytest.raises(CapacityError):
            await queue.admit(other, claim=Claim("pd:{q}:co:other", f"{other.request_id}|1", 60_000))
        assert await r.get("pd:{q}:co:other") is None

    with_redis(go)
