import asyncio

import pytest

from services.registry import Registrar, WorkerInfo
from services.router.prefix_index import PrefixIndex
from services.router.worker_pool import WorkerPool


def info(worker_id: str, role: str = "prefill", **fields) -> WorkerInfo:
    base = dict(address=f"127.0.0.1:{abs(hash(worker_id)) % 50000 + 1000}", model="m", namespace="m",
                block_size=16, max_model_len=2048, ready=True, kv_blocks_total=100)
    base.update(fields)
    return WorkerInfo(worker_id=worker_id, role=role, **base)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def ids(workers):
    return [w.worker_id for w in workers]


def test_registered_worker_appears_with_its_load(with_redis):
    async def go(r):
        p = Registrar(r, info("p1", queued_prefill_tokens=70, num_waiting=2), interval_s=0.5, ttl_s=1.5)
        d = Registrar(r, info("d1", role="decode", kv_blocks_used=40), interval_s=0.5, ttl_s=1.5)
        await p.start()
        await d.start()
        pool = WorkerPool(r, refresh_s=0.2)
        try:
            await pool.start()
            assert ids(pool.prefill_workers()) == ["p1"] and ids(pool.decode_workers()) == ["d1"]
            load = pool.load("d1")
            assert load.kv_blocks_free == 60 and load.inflight_requests == 0
            assert pool.load("p1").pending_prefill_tokens == 70
        finally:
            await pool.stop()
            await p.stop()
            await d.stop()

    with_redis(go)


def test_a_worker_stopped_during_a_heartbeat_lets_it_finish_and_leaves_the_registry(with_redis):
    """A worker SIGTERMed as its first heartbeat ran used to never exit: the cancel landed inside
    redis-py's pipeline. The beat is now left to finish, then the entry is removed (so the late
    beat cannot put it back)."""
    import asyncio

    from services.registry import read_workers

    async def go(r):
        reg = Registrar(r, info("p1"), interval_s=0.05, ttl_s=30)
        beating, release = asyncio.Event(), asyncio.Event()
        real_beat, beats = reg.beat, []

        async def slow_beat():
            beats.append("started")
            if len(beats) == 1:  # the first periodic beat (start()'s own ran before this): held until stop() began
                beating.set()
                await release.wait()
            await real_beat()
            beats.append("done")

        await reg.start()
        reg.beat = slow_beat
        await beating.wait()
        stopping = asyncio.ensure_future(reg.stop())
        await asyncio.sleep(0.2)
        assert not stopping.done()  # it waits for the beat in flight instead of cancelling it
        release.set()
        await stopping
        assert beats[-1] == "done"
        assert await read_workers(r) == []  # gone, and the late beat did not re-add it

    with_redis(go)


def test_dead_worker_leaves_pool_and_index_within_ttl(with_redis):
    async def go(r):
        index = PrefixIndex()
        index.apply("p1", [("s", [1, 2, 3])])
        index.apply("p2", [("s", [1])])
        removed = []

        def on_removed(worker_id):
            removed.append(worker_id)
            index.drop_worker(worker_id)

        regs = [Registrar(r, info(w), interval_s=0.5, ttl_s=1.5) for w in ("p1", "p2")]
        for reg in regs:
            await reg.start()
        pool = WorkerPool(r, refresh_s=0.2, on_removed=on_removed)
        await pool.start()
        try:
            assert ids(pool.prefill_workers()) == ["p1", "p2"]
            # p1's process dies: heartbeats stop, nobody deregisters it
            heartbeat = regs[0]._task
            while not heartbeat.done():
                heartbeat.cancel()
                await asyncio.wait([heartbeat], timeout=0.2)
            loop = asyncio.get_running_loop()
            start = loop.time()
            while "p1" in ids(pool.workers()):
                assert loop.time() - start < 1.5 + 0.2 + 1.5, "dead worker still in the pool"
                await asyncio.sleep(0.05)
            assert ids(pool.prefill_workers()) == ["p2"]
            assert removed == ["p1"]
            assert index.num_blocks("p1") == 0 and index.overlaps([1, 2, 3]) == {"p2": 1}
        finally:
            await pool.stop()
            await regs[1].stop()

    with_redis(go)


def test_draining_and_unready_workers_are_not_offered():
    pool = WorkerPool(None)
    pool.update([info("a"), info("b", ready=False), info("c", draining=True), info("d", role="decode")])
    assert ids(pool.prefill_workers()) == ["a"]
    assert ids(pool.decode_workers()) == ["d"]
    assert ids(pool.workers()) == ["a", "b", "c", "d"]
    pool.update([info("a"), info("b"), info("c"), info("d", role="decode")])  # b became ready, c came back
    assert ids(pool.prefill_workers()) == ["a", "b", "c"]


def test_model_filter():
    pool = WorkerPool(None, model="m")
    pool.update([info("a"), info("b", model="other")])
    assert ids(pool.workers()) == ["a"]


def test_one_pool_per_model():
    pool = WorkerPool(None)
    pool.update([info("a", "decode"), info("b", "decode", model="big"), info("c", model="big"),
                 info("d", "decode", model="big", ready=False)])
    assert pool.models() == ["big", "m"]
    assert ids(pool.decode_workers("m")) == ["a"] and ids(pool.decode_workers("big")) == ["b"]
    assert ids(pool.prefill_workers("big")) == ["c"] and pool.prefill_workers("m") == []
    assert ids(pool.decode_workers()) == ["a", "b"] and pool.decode_workers("unknown") == []
    pool.update([info("a", "decode")])  # the big model's workers left
    assert pool.models() == ["m"] and pool.decode_workers("big") == []


def test_mark_failed_excludes_until_a_heartbeat_after_the_window():
    clock = FakeClock()
    pool = WorkerPool(None, clock=clock)
    pool.update([info("a", heartbeat_at=1.0), info("b", heartbeat_at=1.0)])
    pool.mark_failed("a", for_s=5.0)
    assert ids(pool.prefill_workers()) == ["b"]

    clock.now += 2
    pool.update([info("a", heartbeat_at=2.0), info("b", heartbeat_at=2.0)])  # beat inside the window
    clock.now += 4  # window over, but no heartbeat seen since it ended
    assert ids(pool.prefill_workers()) == ["b"]
    pool.update([info("a", heartbeat_at=2.0), info("b", heartbeat_at=2.0)])  # same beat: still stale
    assert ids(pool.prefill_workers()) == ["b"]
    pool.update([info("a", heartbeat_at=3.0), info("b", heartbeat_at=3.0)])  # a fresh heartbeat
    assert ids(pool.prefill_workers()) == ["a", "b"]


def test_removed_worker_that_returns_is_not_still_failed():
    clock = FakeClock()
    pool = WorkerPool(None, clock=clock)
    pool.update([info("a")])
    pool.mark_failed("a", for_s=60)
    pool.update([])
    pool.update([info("a")])
    assert ids(pool.prefill_workers()) == ["a"]


def test_inflight_accounting():
    pool = WorkerPool(None)
    pool.update([info("a", queued_prefill_tokens=100, num_running=1), info("b")])
    t1 = pool.begin("a", 300)
    t2 = pool.begin("a", 50)
    load = pool.load("a")
    assert (load.inflight_requests, load.inflight_prefill_tokens) == (2, 350)
    assert load.pending_prefill_tokens == 450 and load.num_requests == 3
    assert pool.load("b").inflight_requests == 0

    pool.end_prefill(t1)  # prefill done, request still running
    assert (pool.load("a").inflight_requests, pool.load("a").inflight_prefill_tokens) == (2, 50)
    pool.end(t1)
    pool.end(t1)  # a second end changes nothing
    assert (pool.load("a").inflight_requests, pool.load("a").inflight_prefill_tokens) == (1, 50)
    pool.end(t2)
    assert (pool.load("a").inflight_requests, pool.load("a").inflight_prefill_tokens) == (0, 0)
    with pytest.raises(ValueError):
        pool.begin("a", -1)
    with pytest.raises(KeyError):
        pool.load("unknown")


def test_a_request_that_ended_since_the_heartbeat_is_not_counted_twice():
    pool = WorkerPool(None)
    pool.update([info("d1", role="decode", heartbeat_at=1.0)])
    token = pool.begin("d1")
    # the worker's next heartbeat counts it running; then it ends before the heartbeat after that
    pool.update([info("d1", role="decode", heartbeat_at=2.0, num_running=1)])
    assert pool.load("d1").active_requests == 1
    pool.end(token)
    assert pool.load("d1").active_requests == 0  # a conversation's next turn finds the worker free
    # a request that began and ended between two heartbeats was never in one: nothing to discount
    pool.end(pool.begin("d1"))
    assert pool.load("d1").ended_since_beat == 1
    pool.update([info("d1", role="decode", heartbeat_at=3.0, num_running=0)])
    assert pool.load("d1").ended_since_beat == 0 and pool.load("d1").active_requests == 0
    # another router's request in the heartbeat stays counted
    pool.update([info("d1", role="decode", heartbeat_at=4.0, num_running=2)])
    assert pool.load("d1").active_requests == 2


def test_the_pool_follows_published_changes_without_reading_the_registry(with_redis):
    """A worker joining, its heartbeats' load and its leaving reach the pool as they are published: no
    whole-registry read after the first ones (an idle router used to read it every 250 ms)."""
    async def go(r):
        pool = WorkerPool(r, refresh_s=0.05, reread_s=60)
        await pool.start()
        reg = Registrar(r, info("d1", role="decode", kv_blocks_used=10), interval_s=0.05, ttl_s=30)
        try:
            async def until(condition) -> None:
                while not condition():
                    await asyncio.sleep(0.01)

            await asyncio.sleep(0.1)  # the follower subscribed and made its first read
            reads = pool.registry_reads
            await asyncio.wait_for(reg.start(), 5)
            await asyncio.wait_for(until(lambda: ids(pool.decode_workers()) == ["d1"]), 5)
            reg.info.kv_blocks_used = 70  # the next heartbeat carries it
            await asyncio.wait_for(until(lambda: pool.load("d1").kv_blocks_free == 30), 5)
            await reg.stop()
            await asyncio.wait_for(until(lambda: pool.workers() == []), 5)
            return reads, pool.registry_reads
        finally:
            await pool.stop()
            await reg.stop()

    before, after = with_redis(go)
    assert after == before
