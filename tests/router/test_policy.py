from collections import Counter

import pytest

from services.engine.block_hash import hash_prompt_blocks
from services.errors import CapacityError, NoWorkerError
from services.registry import WorkerInfo
from services.router.policy import (
    POLICY_NAMES,
    KVAwarePolicy,
    RouterPolicyConfig,
    decode_is_busy,
    make_policy,
    should_prefill_locally,
)
from services.router.prefix_index import PrefixIndex
from services.router.worker_pool import WorkerPool

BS = 16


def info(worker_id: str, role: str = "prefill", **fields) -> WorkerInfo:
    base = dict(address="127.0.0.1:1", model="m", namespace="m", block_size=BS, max_model_len=4096,
                ready=True, kv_blocks_total=100)
    base.update(fields)
    return WorkerInfo(worker_id=worker_id, role=role, **base)


def pool_of(*workers: WorkerInfo) -> WorkerPool:
    pool = WorkerPool(None)
    pool.update(workers)
    return pool


def prompt(n_tokens: int, first: int = 0) -> tuple[list[int], list[int]]:
    tokens = list(range(first, first + n_tokens))
    return tokens, hash_prompt_blocks(tokens, BS, "m")


def test_kv_aware_picks_the_worker_holding_the_prefix():
    tokens, hashes = prompt(8 * BS + 5)
    index = PrefixIndex()
    index.apply("b", [("s", hashes[:6])])
    index.apply("c", [("s", hashes[:2])])
    pool = pool_of(info("a"), info("b"), info("c"))
    policy = make_policy("kv-aware")
    d = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert (d.worker.worker_id, d.reason, d.overlap_blocks) == ("b", "prefix_hit", 6)
    assert d.cost == len(tokens) - 6 * BS

    # the holder failed this request before: the next-best prefix wins
    d = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, exclude={"b"},
                              num_tokens=len(tokens))
    assert (d.worker.worker_id, d.reason, d.overlap_blocks) == ("c", "prefix_hit", 2)

    # an unrelated prompt: no overlap anywhere, decided by load
    _, other = prompt(4 * BS, first=10_000)
    pool.begin("a", 500)
    d = policy.choose_prefill(pool.prefill_workers(), other, BS, pool, index)
    assert (d.worker.worker_id, d.reason, d.overlap_blocks) == ("b", "load", 0)


def test_hot_prefix_spills_to_other_workers_under_load():
    tokens, hashes = prompt(8 * BS + 10)
    index = PrefixIndex()
    index.apply("hot", [("s", hashes)])
    pool = pool_of(info("cold"), info("hot"))
    policy = make_policy("kv-aware")
    chosen = []
    for _ in range(50):  # a burst: none finishes, heartbeats would not have moved yet
        d = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
        pool.begin(d.worker.worker_id, len(tokens) - d.overlap_blocks * BS)
        chosen.append(d.worker.worker_id)
    counts = Counter(chosen)
    assert chosen[0] == "hot"
    assert counts["cold"] > 0 and counts["hot"] > counts["cold"]
    assert pool.load("hot").inflight_requests + pool.load("cold").inflight_requests == 50


def test_holder_keeps_a_long_prefix_while_its_queue_is_a_prefill_or_two():
    # a 1,024-token system prompt: computing it again elsewhere costs more than waiting behind
    # one or two prefills of the same size on its holder, and copies it onto a second worker
    tokens, hashes = prompt(64 * BS + 20)
    index = PrefixIndex()
    index.apply("holder", [("s", hashes[:64])])
    pool = pool_of(info("holder", kv_blocks_total=1000), info("idle", kv_blocks_total=1000))
    policy = make_policy("kv-aware")
    pool.begin("holder", 2 * 1044)  # two uncached prompts of the same size went there just now
    d = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert (d.worker.worker_id, d.reason, d.overlap_blocks) == ("holder", "prefix_hit", 64)
    # truly overloaded (five such prefills queued): the request goes where it starts sooner
    pool.begin("holder", 3 * 1044)
    d = policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, num_tokens=len(tokens))
    assert (d.worker.worker_id, d.reason) == ("idle", "load")


def test_new_prefix_goes_where_it_evicts_no_shared_blocks():
    # room for 12 blocks each. "a" serves three shared 4-block prefixes (its cache is full of
    # blocks that served two prompts each), "b" one: a fourth prefix fits on b without evicting
    # anything another request is likely to want, so it goes there though a is first by id
    shared = [prompt(4 * BS, first=1000 * i)[1] for i in range(4)]
    index = PrefixIndex()
    for _ in range(2):
        for h in shared[:3]:
            index.touch("a", h)
        index.touch("b", shared[3])
    pool = pool_of(info("a", kv_blocks_total=12), info("b", kv_blocks_total=12))
    _, new = prompt(4 * BS, first=9000)
    d = make_policy("kv-aware").choose_prefill(pool.prefill_workers(), new, BS, pool, index)
    assert (d.worker.worker_id, d.reason) == ("b", "load")
    assert d.cost == 4 * BS  # b evicts nothing: the cost is the prompt's own compute
    # with equal room, the tie goes by id as before
    for h in shared[:2]:
        index.touch("b", h)
    d = make_policy("kv-aware").choose_prefill(pool.prefill_workers(), new, BS, pool, index)
    assert d.worker.worker_id == "a"


def test_heartbeat_queue_counts_as_load():
    _, hashes = prompt(2 * BS)
    index = PrefixIndex()
    index.apply("a", [("s", hashes)])
    # a holds the whole prompt (saves 32 tokens) but 1000 tokens are queued ahead on it
    pool = pool_of(info("a", queued_prefill_tokens=1000), info("b"))
    d = make_policy("kv-aware").choose_prefill(pool.prefill_workers(), hashes, BS, pool, index)
    assert (d.worker.worker_id, d.reason) == ("b", "load")
    # with load ignored, the cache wins
    d = make_policy("kv-aware", load_weight=0.0).choose_prefill(pool.prefill_workers(), hashes, BS, pool, index)
    assert d.worker.worker_id == "a"


def test_single_candidate_is_only_worker():
    _, hashes = prompt(3 * BS)
    index = PrefixIndex()
    index.apply("a", [("s", hashes[:1])])
    pool = pool_of(info("a"), info("b"))
    for name in POLICY_NAMES:
        d = make_policy(name).choose_prefill(pool.prefill_workers(), hashes, BS, pool, index, exclude=["b"])
        assert (d.worker.worker_id, d.reason, d.overlap_blocks) == ("a", "only_worker", 1)


def test_no_candidate_raises_no_worker():
    pool = pool_of(info("a"))
    for name in POLICY_NAMES:
        with pytest.raises(NoWorkerError, match="no prefill worker"):
            make_policy(name).choose_prefill(pool.prefill_workers(), [], BS, pool, None, exclude=["a"])
        with pytest.raises(NoWorkerError, match="no decode worker"):
            make_policy(name).choose_decode([], 1, pool)


def test_round_robin_alternates_in_id_order():
    pool = pool_of(info("c"), info("a"), info("b"))
    policy = make_policy("round-robin")
    picks = [policy.choose_prefill(pool.prefill_workers(), [], BS, pool, None).worker.worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    # a worker leaving keeps the rotation going from where it was
    pool.update([info("a"), info("c")])
    d = policy.choose_prefill(pool.prefill_workers(), [], BS, pool, None)
    assert (d.worker.worker_id, d.reason) == ("a", "round_robin")
    assert policy.choose_prefill(pool.prefill_workers(), [], BS, pool, None).worker.worker_id == "c"


def test_least_load_picks_the_idler():
    pool = pool_of(info("a", queued_prefill_tokens=200), info("b", queued_prefill_tokens=50), info("c"))
    policy = make_policy("least-load")
    pool.begin("c", 400)  # c reported nothing yet, but this router just sent it 400 tokens
    d = policy.choose_prefill(pool.prefill_workers(), [], BS, pool, None)
    assert (d.worker.worker_id, d.reason) == ("b", "least_load")


def test_decode_needs_room_then_prefers_the_least_loaded():
    pool = pool_of(info("d1", "decode", kv_blocks_used=95, num_running=0),
                   info("d2", "decode", kv_blocks_used=50, num_running=4),
                   info("d3", "decode", kv_blocks_used=60, num_running=1))
    policy = make_policy("kv-aware")
    d = policy.choose_decode(pool.decode_workers(), 20, pool)
    assert (d.worker.worker_id, d.reason) == ("d3", "least_load")  # d1 is idle but has 5 blocks free
    d = policy.choose_decode(pool.decode_workers(), 45, pool)
    assert (d.worker.worker_id, d.reason) == ("d2", "most_room")
    with pytest.raises(CapacityError, match=r"no decode worker has 51 free KV blocks .*most free: 50 on d2"):
        policy.choose_decode(pool.decode_workers(), 51, pool)
    with pytest.raises(CapacityError, match="exceeds every worker's whole cache"):
        policy.choose_decode(pool.decode_workers(), 101, pool)
    # this router's own in-flight requests count as load
    pool.begin("d3")
    pool.begin("d3")
    pool.begin("d3")
    pool.begin("d3")
    d = policy.choose_decode(pool.decode_workers(), 20, pool)
    assert d.worker.worker_id == "d2"  # 4 running + 50 free beats 5 requests


def test_round_robin_decode_cycles_over_workers_that_fit():
    pool = pool_of(info("d1", "decode"), info("d2", "decode", kv_blocks_used=99), info("d3", "decode"))
    policy = make_policy("round-robin")
    picks = [policy.choose_decode(pool.decode_workers(), 10, pool).worker.worker_id for _ in range(4)]
    assert picks == ["d1", "d3", "d1", "d3"]


def test_temperature_zero_is_deterministic_and_positive_spreads_ties():
    _, hashes = prompt(4 * BS)
    pool = pool_of(info("b"), info("a"), info("c"))
    index = PrefixIndex()

    cold = make_policy("kv-aware", temperature=0.0)
    picks = {cold.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index).worker.worker_id
             for _ in range(50)}
    assert picks == {"a"}  # equal costs: first by id, every time

    def sample(seed):
        policy = make_policy("kv-aware", temperature=1.0, seed=seed)
        return [policy.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index).worker.worker_id
                for _ in range(300)]

    spread = Counter(sample(7))
    assert set(spread) == {"a", "b", "c"} and min(spread.values()) > 50
    assert sample(7) == sample(7)  # seeded: reproducible

    # a near-tie is sampled less often; a worker beyond tie_tokens never
    pool.begin("b", 20)  # within tie_tokens (32) of the best
    pool.begin("c", 200)  # far worse
    picks = Counter(sample(3))
    assert picks["c"] == 0 and 0 < picks["b"] < picks["a"]


def test_make_policy_and_config_validation():
    with pytest.raises(ValueError, match="kv-aware, least-load, round-robin"):
        make_policy("random")
    with pytest.raises(ValueError, match="unknown routing policy option"):
        make_policy("kv-aware", load_wieght=2)
    for bad in (dict(load_weight=-1), dict(temperature=float("nan")), dict(tie_tokens=-5),
                dict(local_prefill_max_tokens=-1), dict(prefill_queue_limit_tokens=-1), dict(policy="nope")):
        with pytest.raises(ValueError):
            RouterPolicyConfig(**bad)
    assert isinstance(make_policy("kv-aware", temperature=0.5, seed=1), KVAwarePolicy)


def test_should_prefill_locally():
    off = RouterPolicyConfig()  # defaults: always disaggregate when prefill workers exist
    assert should_prefill_locally(10, 0, has_prefill_workers=False, config=off)
    assert not should_prefill_locally(10, 10**6, has_prefill_workers=True, config=off)
    assert not should_prefill_locally(0, 0, has_prefill_workers=True, config=off)

    on = RouterPolicyConfig(local_prefill_max_tokens=256, prefill_queue_limit_tokens=8192)
    assert should_prefill_locally(200, 0, True, on)
    assert not should_prefill_locally(200, 0, True, on, decode_busy=True)
    assert not should_prefill_locally(300, 0, True, on)
    assert should_prefill_locally(3000, 9000, True, on)  # the prefill tier is saturated


def test_decode_is_busy():
    config = RouterPolicyConfig(local_prefill_max_tokens=256)
    pool = pool_of(info("d", "decode"), info("w", "decode", num_waiting=1))
    assert not decode_is_busy(pool.load("d"), config)
    assert decode_is_busy(pool.load("w"), config)
    pool.begin("d", 256)  # already doing a full allowance of local prefill
    assert decode_is_busy(pool.load("d"), config)
