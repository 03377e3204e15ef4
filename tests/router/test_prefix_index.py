import asyncio
import random

from services import kv_events
from services.engine.block_hash import hash_prompt_blocks
from services.router.prefix_index import KVEventFollower, PrefixIndex

BS = 4
NS = "model-a"


def prompt_hashes(n_blocks: int, first: int = 0) -> list[int]:
    return hash_prompt_blocks(list(range(first, first + n_blocks * BS)), BS, NS)


def test_stored_removed_cleared():
    h = prompt_hashes(4)
    index = PrefixIndex()
    index.apply("w1", [("s", h)])
    index.apply("w2", [("s", h[:2])])
    assert index.overlap("w1", h) == 4 and index.overlap("w2", h) == 2
    assert index.num_blocks("w1") == 4 and len(index) == 4

    index.apply("w1", [("r", [h[0]])])  # evicting the first block makes the rest useless
    assert index.overlap("w1", h) == 0
    assert index.overlap("w2", h) == 2  # a block shared with w2 stays w2's
    assert index.num_blocks("w1") == 3

    # one publish: cleared, then stored again, in that order
    index.apply("w1", [("c", []), ("s", h[:1])])
    assert index.num_blocks("w1") == 1 and index.overlap("w1", h) == 1
    index.apply("w2", [("c", [])])
    assert index.num_blocks("w2") == 0 and index.workers() == ["w1"]
    assert len(index) == 1

    index.apply("w3", [("r", h)])  # removing what was never stored changes nothing
    assert index.workers() == ["w1"]


def test_overlap_stops_at_first_miss():
    h = prompt_hashes(6)
    index = PrefixIndex()
    index.apply("gap", [("s", [h[0], h[1], h[3], h[4], h[5]])])  # holds all but block 2
    index.apply("full", [("s", h)])
    index.apply("tail", [("s", h[1:])])  # no first block: nothing usable
    other = prompt_hashes(3, first=1000)
    index.apply("other", [("s", other)])

    assert index.overlap("gap", h) == 2
    assert index.overlap("tail", h) == 0
    assert index.overlaps(h) == {"gap": 2, "full": 6}
    assert index.overlaps(other) == {"other": 3}
    assert index.overlaps(h[:1]) == {"gap": 1, "full": 1}
    assert index.overlaps([]) == {}
    # a different namespace hashes the same tokens differently
    assert index.overlaps(hash_prompt_blocks(list(range(6 * BS)), BS, "model-b")) == {}


def test_overlaps_agrees_with_each_workers_overlap():
    # overlaps walks the prompt once for every worker at a time; it must give each worker what overlap
    # gives it alone, whatever gaps, removals, spilled blocks and unknown blocks the index holds
    h = prompt_hashes(30)
    for trial in range(200):
        rng = random.Random(trial)
        index = PrefixIndex()
        for w in range(6):
            index.apply(f"w{w}", [("s", h[:rng.randint(0, 30)]), ("r", rng.sample(h, rng.randint(0, 5)))])
            if rng.random() < 0.3:
                index.apply(f"w{w}", [("s", rng.sample(h, 3), kv_events.SPILL)])
        for _ in range(10):
            prompt = h[:rng.randint(0, 30)] + (prompt_hashes(1, first=999) if rng.random() < 0.3 else [])
            alone = {w: index.overlap(w, prompt) for w in index.workers()}
            assert index.overlaps(prompt) == {w: n for w, n in alone.items() if n > 0}


def test_touch_models_the_workers_lru_cache():
    a, b = prompt_hashes(3), prompt_hashes(3, first=100)
    index = PrefixIndex()
    index.touch("w", a)
    index.touch("w", b)
    index.touch("w", a)  # a served two prompts, b one; b is now the least recently used
    assert index.overlap("w", a) == 3 and index.overlaps(b) == {"w": 3}  # predicted to be held
    assert index.num_blocks("w") == 6

    with_room, big = prompt_hashes(2, first=200), prompt_hashes(5, first=300)
    assert index.reused_evictions("w", with_room, capacity=8) == 0  # fits without evicting
    assert index.reused_evictions("w", with_room, capacity=6) == 0  # evicts 2 of b's (used once)
    assert index.reused_evictions("w", big, capacity=6) == 2  # all of b's, then 2 of a's
    # a prompt that uses a's blocks refreshes them rather than evicting them
    assert index.reused_evictions("w", a + prompt_hashes(3, first=400), capacity=6) == 0

    # the worker's events keep the model honest: what it evicted is no longer counted as held
    index.apply("w", [("r", b)])
    assert index.num_blocks("w") == 3 and index.overlaps(b) == {}
    assert index.reused_evictions("w", big, capacity=6) == 2  # 3 free, then 2 of a's
    # blocks the worker stored for another router's request count as used once, recently
    index.apply("w", [("s", b)])
    assert index.reused_evictions("w", prompt_hashes(3, first=500), capacity=6) == 3  # a's are older
    index.touch("w", a)
    assert index.reused_evictions("w", prompt_hashes(3, first=500), capacity=6) == 0
    assert index.reused_evictions("nobody", big, capacity=6) == 0

    # a worker holds no more than its capacity: the least recently used predictions are forgotten
    index.touch("w", big, capacity=6)
    assert index.num_blocks("w") == 6 and index.overlap("w", big) == 5
    assert index.overlap("w", a) == 1 and index.overlaps(b) == {}  # a's head was the most recent of the rest


def test_drop_worker_forgets_only_that_worker():
    h = prompt_hashes(3)
    index = PrefixIndex()
    index.apply("a", [("s", h)])
    index.apply("b", [("s", h[:2])])
    index.drop_worker("a")
    assert index.num_blocks("a") == 0
    assert index.overlaps(h) == {"b": 2}
    assert len(index) == 2
    index.drop_worker("never-seen")


async def wait_for(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def test_follower_rebuilds_from_stream_then_follows(with_redis):
    a, b = prompt_hashes(5), prompt_hashes(3, first=500)

    async def go(r):
        # history written before the router starts
        await kv_events.publish_cleared(r, "w1")
        await kv_events.publish(r, "w1", [["s", a]])
        await kv_events.publish(r, "w2", [["s", a[:2] + b]])
        await kv_events.publish(r, "w1", [["r", a[3:]]])
        last = (await r.xrevrange(kv_events.STREAM_KEY, count=1))[0][0].decode()

        index = PrefixIndex()
        follower = KVEventFollower(r, index, block_ms=100)
        await follower.start()
        try:
            assert await follower.caught_up(timeout=10)
            assert follower.last_id == last and follower.entries_applied == 4
            assert index.overlaps(a) == {"w1": 3, "w2": 2}
            assert index.overlaps(b) == {"w2": 3}

            # events published after the rebuild are followed
            await kv_events.publish(r, "w1", [["s", a[3:]], ["r", a[:1]]])
            await kv_events.publish(r, "w3", [["s", b]])
            await wait_for(lambda: follower.entries_applied == 6)
            assert index.overlaps(a) == {"w2": 2}  # w1 lost block 0: its later blocks are useless
            assert index.overlaps(b) == {"w2": 3, "w3": 3}
            await kv_events.publish_cleared(r, "w2")
            await wait_for(lambda: follower.entries_applied == 7)
            assert index.overlaps(b) == {"w3": 3} and index.num_blocks("w2") == 0
        finally:
            await follower.stop()

    with_redis(go)


def test_follower_on_empty_stream_is_caught_up_and_sees_first_events(with_redis):
    h = prompt_hashes(2)

    async def go(r):
        index = PrefixIndex()
        follower = KVEventFollower(r, index, block_ms=100)
        await follower.start()
        try:
            assert await follower.caught_up(timeout=5)
            await kv_events.publish(r, "w1", [["s", h]])
            await wait_for(lambda: index.overlap("w1", h) == 2)
        finally:
            await follower.stop()

    with_redis(go)


class FlakyRedis:
    """Delegates to a real client but fails the first few stream reads, as a Redis restart would."""

    def __init__(self, real, failures: int):
        self.real, self.failures = real, failures

    async def xread(self, *args, **kwargs):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("connection reset by peer")
        return await self.real.xread(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_follower_survives_redis_errors_without_skipping_or_repeating(with_redis):
    h = prompt_hashes(4)

    async def go(r):
        for i in range(4):
            await kv_events.publish(r, f"w{i}", [["s", h[: i + 1]]])
        flaky = FlakyRedis(r, failures=2)
        index = PrefixIndex()
        follower = KVEventFollower(flaky, index, block_ms=100, batch=2)
        await follower.start()
        try:
            assert await follower.caught_up(timeout=10)
            assert flaky.failures == 0
            assert follower.entries_applied == 4
            assert index.overlaps(h) == {"w0": 1, "w1": 2, "w2": 3, "w3": 4}
        finally:
            await follower.stop()

    with_redis(go)


def test_caught_up_times_out_while_redis_is_unreachable():
    async def go():
        import redis.asyncio as aioredis

        r = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        follower = KVEventFollower(r, PrefixIndex(), block_ms=100, max_backoff_s=0.2)
        await follower.start()
        try:
            assert not await follower.caught_up(timeout=0.5)
            assert follower.last_id == "0"
        finally:
            await follower.stop()
            await r.aclose()

    asyncio.run(go())


def test_stop_always_ends_the_follower(with_redis):
    # redis-py may swallow a cancel that lands as a blocking read returns; stop() must still end it.
    async def go(r):
        for i in range(8):
            follower = KVEventFollower(r, PrefixIndex(), block_ms=50)
            await follower.start()
            await asyncio.sleep(0.02 + 0.013 * i)
            await asyncio.wait_for(follower.stop(), 3)
            assert not follower.running

    with_redis(go)


def test_follower_reads_resp3_replies(redis_url):
    # RESP3 shapes XREAD replies differently ({stream: [[entries]]}); a router configured
    # with protocol=3 must build the same index.
    h = prompt_hashes(3)

    async def go():
        import redis.asyncio as aioredis

        r = aioredis.Redis.from_url(redis_url, protocol=3)
        try:
            await r.flushdb()
            await kv_events.publish(r, "w1", [["s", h]])
            await kv_events.publish(r, "w2", [["s", h[:1]]])
            index = PrefixIndex()
            follower = KVEventFollower(r, index, block_ms=100)
            await follower.start()
            try:
                assert await follower.caught_up(timeout=10)
                assert index.overlaps(h) == {"w1": 3, "w2": 1}
            finally:
                await follower.stop()
        finally:
            await r.aclose()

    asyncio.run(go())
