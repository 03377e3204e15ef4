"""kv-aware skips the eviction charge of workers that cannot win: the choice must not change."""

import math
import random

import pytest

from services.router.policy import make_policy
from services.router.prefix_index import PrefixIndex
from tests.router.test_policy import BS, info, pool_of


def exhaustive(policy, workers, hashes, num_tokens, pool, index):
    """Every worker's full cost, the cheapest first by id (the rule, computed the slow way)."""
    overlaps = index.overlaps(hashes)
    costs = []
    for w in sorted(workers, key=lambda w: w.worker_id):
        uncached = max(0, num_tokens - overlaps.get(w.worker_id, 0) * BS)
        cost = policy.cost(pool.load(w.worker_id), uncached)
        cost += BS * index.reused_evictions(w.worker_id, hashes, w.kv_blocks_total)
        costs.append((cost, w.worker_id))
    best = min(c for c, _ in costs)
    return next(wid for c, wid in costs if c == best), best


@pytest.mark.parametrize("seed", range(40))
def test_pruned_choice_equals_the_exhaustive_one(seed):
    rng = random.Random(seed)
    workers = [info(f"p{i:02d}", kv_blocks_total=rng.choice([40, 80, 160])) for i in range(rng.randint(2, 24))]
    pool = pool_of(*workers)
    index = PrefixIndex()
    prefixes = [[rng.getrandbits(60) for _ in range(rng.randint(4, 60))] for _ in range(12)]
    for w in workers:  # fill the caches (some past capacity, so evictions are charged) and load the workers
        for _ in range(rng.randint(0, 6)):
            index.touch(w.worker_id, rng.choice(prefixes), w.kv_blocks_total)
        for _ in range(rng.randint(0, 3)):
            pool.begin(w.worker_id, rng.choice([0, 16, 300, 2000]))
    policy = make_policy("kv-aware")
    for _ in range(20):
        hashes = rng.choice(prefixes)[: rng.randint(1, 60)] + [rng.getrandbits(60) for _ in range(rng.randint(0, 30))]
        num_tokens = len(hashes) * BS + rng.randint(0, BS - 1)
        d = policy.choose_prefill(workers, hashes, BS, pool, index, num_tokens=num_tokens)
        wid, cost = exhaustive(policy, workers, hashes, num_tokens, pool, index)
        assert (d.worker.worker_id, d.cost) == (wid, cost)


def test_sampling_among_near_ties_sees_every_near_tie():
    # two workers within tie_tokens of each other, a third far worse: with a temperature both near
    # ties are chosen over many draws, the far one never
    workers = [info("a"), info("b"), info("c")]
    pool = pool_of(*workers)
    pool.begin("b", 40)  # 0.25 * 40 = 10 tokens worse than a
    pool.begin("c", 4000)
    policy = make_policy("kv-aware", temperature=1.0, seed=3)
    hashes = [1, 2, 3]
    picks = {policy.choose_prefill(workers, hashes, BS, pool, PrefixIndex()).worker.worker_id for _ in range(200)}
    assert picks == {"a", "b"}
    assert math.isfinite(policy.choose_prefill(workers, hashes, BS, pool, PrefixIndex()).cost)
