"""The peer-fetch cost model and the kv-aware policy's three choices: the holder (its queue), another
worker computing the prefix, another worker fetching it (services/router/fetch_cost.py)."""

import pytest

from services.router.fetch_cost import HOLDER_STEP_TOKENS, fetch_tokens, plan_fetch
from services.router.policy import RouterPolicyConfig, make_policy
from services.router.prefix_index import PrefixIndex
from tests.router.test_policy import BS, info, pool_of, prompt

BLOCK_BYTES = 368_640  # the default model's bf16 block: 30 layers x K,V x 16 slots x 3 heads x 64 x 2 bytes
CPU = dict(bandwidth_bytes_per_s=2e9, prefill_tokens_per_s=600.0)


def test_fetch_tokens_is_transfer_time_as_prefill_time_plus_the_holders_step():
    # 100 blocks at 2 GB/s: 18.4 ms + 5 ms fixed; at 600 tokens/s that is 14 tokens' prefill, plus the
    # holder's last block (16) and nothing queued there
    assert fetch_tokens(100, BLOCK_BYTES, BS, 0, **CPU) == pytest.approx(0.0234 * 600 + 16, rel=1e-3)
    # a busy holder costs a fetch its step in progress, never its whole queue (a fetch runs first)
    assert fetch_tokens(100, BLOCK_BYTES, BS, 50_000, **CPU) - fetch_tokens(100, BLOCK_BYTES, BS, 0, **CPU) \
        == HOLDER_STEP_TOKENS
    # ten times the bandwidth: the transfer share a tenth
    slow = fetch_tokens(100, BLOCK_BYTES, BS, 0, 0.2e9, 600.0)
    assert slow > 10 * (fetch_tokens(100, BLOCK_BYTES, BS, 0, **CPU) - 16 - 3)


def test_plan_fetch_only_when_cheaper_than_computing():
    here, holder = info("a", kv_block_bytes=BLOCK_BYTES), info("b", kv_block_bytes=BLOCK_BYTES)
    n = 138 * BS  # a 2.2k-token history the holder has all of
    plan = plan_fetch(here, [holder], {"b": 137}, {}, {}, n, BS, float(n), restore_token_cost=0.05, **CPU)
    assert plan is not None and plan.holder is holder and plan.blocks == 137
    assert plan.cost < 0.1 * n  # on this CPU a fetch costs a few percent of computing the prefix
    # on a GPU-like prefill (40k tokens/s) over a slow link, a 2-block prefix is cheaper to compute
    plan = plan_fetch(here, [holder], {"b": 2}, {}, {}, 3 * BS, BS, 3.0 * BS, bandwidth_bytes_per_s=0.1e9,
                      prefill_tokens_per_s=40_000.0, restore_token_cost=0.05)
    assert plan is None
    # the worker holds as much as the holder: nothing to fetch
    assert plan_fetch(here, [holder], {"a": 5, "b": 5}, {}, {}, n, BS, float(n - 5 * BS),
                      restore_token_cost=0.05, **CPU) is None
    # a holder that never reported its block size (and a worker that did not either): no fetch
    bare = info("c")
    assert plan_fetch(info("d"), [bare], {"c": 137}, {}, {}, n, BS, float(n), restore_token_cost=0.05, **CPU) is None


def test_kv_aware_fetches_to_an_idle_worker_when_the_holder_is_busy():
    tokens, hashes = prompt(137 * BS + 10)
    index = PrefixIndex()
    index.apply("holder", [("s", hashes)])
    pool = pool_of(info("holder", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES),
                   info("idle", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES))
    fetching = make_policy("kv-aware", peer_fetch=True)
    plain = make_policy("kv-aware")
    # idle holder: routing there beats fetching (the fetch still costs its transfer): no fetch
    d = fetching.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert (d.worker.worker_id, d.fetch) == ("holder", None)
    # the holder has 20k prompt tokens queued: without peer fetch the request waits there (the
    # prefix is worth ~4x the queue it saves)... or recomputes elsewhere under more load
    pool.begin("holder", 20_000)
    d = fetching.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert d.worker.worker_id == "idle" and d.fetch is not None
    assert (d.fetch.holder.worker_id, d.fetch.blocks) == ("holder", 137)
    # what it still computes (10 tokens), the transfer and the last block, the holder's step in progress
    assert d.cost == pytest.approx(10 + fetch_tokens(137, BLOCK_BYTES, BS, 20_000, **CPU))
    assert d.cost < len(tokens) / 3  # far below computing the 2.2k tokens there
    d_plain = plain.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert d_plain.fetch is None and d_plain.cost > d.cost
    # the holder's prefix is in its spill tier: a restore on top of the fetch costs more, still the cheapest
    index.apply("holder", [("s", hashes, "spill")])
    spilled = fetching.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert spilled.worker.worker_id == "idle" and spilled.fetch is not None
    assert spilled.cost == pytest.approx(d.cost + 0.05 * BS * 137)


def test_round_robin_with_peer_fetch_fetches_where_the_prefix_is_elsewhere():
    tokens, hashes = prompt(40 * BS + 3)
    index = PrefixIndex()
    index.apply("a", [("s", hashes)])
    pool = pool_of(info("a", kv_block_bytes=BLOCK_BYTES), info("b", kv_block_bytes=BLOCK_BYTES))
    policy = make_policy("round-robin", peer_fetch=True)
    first = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    second = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert (first.worker.worker_id, first.fetch) == ("a", None)  # the holder itself: nothing to fetch
    assert second.worker.worker_id == "b" and second.fetch.holder.worker_id == "a" and second.fetch.blocks == 40
    off = make_policy("round-robin")
    off.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert off.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens)).fetch is None


def test_peer_fetch_rates_are_validated():
    with pytest.raises(ValueError, match="peer_fetch_bandwidth_gbps"):
        RouterPolicyConfig(peer_fetch=True, peer_fetch_bandwidth_gbps=0)
    with pytest.raises(ValueError, match="peer_fetch_prefill_tokens_per_s"):
        RouterPolicyConfig(peer_fetch_prefill_tokens_per_s=float("nan"))


def test_a_workers_measured_fetch_rate_prices_its_fetches():
    tokens, hashes = prompt(137 * BS + 10)
    index = PrefixIndex()
    index.apply("holder", [("s", hashes)])
    pool = pool_of(info("holder", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES),
                   info("idle", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES))
    pool.begin("holder", 20_000)
    policy = make_policy("kv-aware", peer_fetch=True)
    fast = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    # the idle worker's fetches measured 73 MB/s end to end (bench kvtier on the loaded machine): dearer,
    # still far cheaper than computing 2.2k tokens
    pool.update([info("holder", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES),
                 info("idle", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES, kv_fetch_bytes_per_s=73e6)])
    slow = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert slow.worker.worker_id == "idle" and slow.fetch is not None
    assert slow.cost == pytest.approx(10 + fetch_tokens(137, BLOCK_BYTES, BS, 20_000, 73e6, 600.0))
    assert slow.cost > fast.cost + 300
    # measured at 5 MB/s, computing the prefix here is cheaper than fetching it
    pool.update([info("holder", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES),
                 info("idle", kv_blocks_total=1000, kv_block_bytes=BLOCK_BYTES, kv_fetch_bytes_per_s=5e6)])
    crawl = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert crawl.fetch is None
