"""The router's view of workers' KV tiers: KV events with a tier, the index, the policy's cost."""

from services.engine.block_pool import SPILL, BlockRemoved, BlockStored
from services.kv_events import decode_entry, encode
from services.router.policy import make_policy
from services.router.prefix_index import PrefixIndex
from tests.router.test_policy import BS, info, pool_of, prompt


def test_events_carry_the_tier_over_the_wire():
    runs = encode([BlockStored((1, 2), None, (), SPILL), BlockStored((3,), 2, ()), BlockRemoved((1,), SPILL)])
    assert runs == [["s", [1, 2], "spill"], ["s", [3]], ["r", [1], "spill"]]
    import json

    worker, decoded = decode_entry({"worker": "w", "events": json.dumps(runs)})
    assert decoded == [("s", [1, 2], "spill"), ("s", [3]), ("r", [1], "spill")]


def test_index_follows_blocks_between_tiers():
    _, hashes = prompt(6 * BS)
    index = PrefixIndex()
    index.apply("w", [("s", hashes)])
    assert index.spilled_run("w", hashes, 6) == 0
    index.apply("w", [("s", hashes[3:], "spill")])  # the tail left the pool for the spill tier
    assert index.overlap("w", hashes) == 6 and index.spilled_run("w", hashes, 6) == 3
    index.apply("w", [("s", hashes[3:5])])  # restored into the pool
    assert index.spilled_run("w", hashes, 6) == 1
    index.apply("w", [("r", hashes[5:], "spill")])  # the spill tier dropped the last one
    assert index.overlap("w", hashes) == 5 and index.num_spilled("w") == 0
    index.apply("w", [("s", hashes[4:5], "spill"), ("c", [])])
    assert index.overlap("w", hashes) == 0 and index.num_spilled("w") == 0


def test_a_spilled_prefix_costs_more_than_a_pooled_one_and_far_less_than_none():
    tokens, hashes = prompt(40 * BS + 3)
    index = PrefixIndex()
    index.apply("pooled", [("s", hashes)])
    index.apply("spilled", [("s", hashes, "spill")])
    pool = pool_of(info("none"), info("pooled"), info("spilled"))
    policy = make_policy("kv-aware")
    d = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert d.worker.worker_id == "pooled"
    d = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, exclude={"pooled"},
                              num_tokens=len(tokens))
    assert d.worker.worker_id == "spilled" and d.reason == "prefix_hit"
    assert 3 < d.cost < 0.1 * len(tokens)  # the copy back is charged, far below a recompute


def test_a_resync_after_lost_events_restores_the_spill_tier_too(with_redis):
    """A worker whose publishes failed resyncs: the router's index gets its pool and spill tier back."""
    from services.kv_events import STREAM_KEY, Publisher

    _, hashes = prompt(6 * BS)

    async def go(redis):
        publisher = Publisher(redis, "w")
        await publisher.publish([], cached=hashes[:3], spilled=hashes[3:])
        index = PrefixIndex()
        for _, fields in (await redis.xrange(STREAM_KEY)):
            worker, runs = decode_entry(fields)
            index.apply(worker, runs)
        return index

    index = with_redis(go)
    assert index.overlap("w", hashes) == 6 and index.spilled_run("w", hashes, 6) == 3
