"""The pool's load rankings: the choices read from them must equal the linear scans they replace."""

import random

import pytest

from services.errors import CapacityError
from services.router.load_ranking import LoadRanking
from services.router.policy import make_policy
from services.router.prefix_index import PrefixIndex
from tests.router.test_policy import BS, info, pool_of


def test_ordered_yields_every_member_once_in_key_order_after_rekeys():
    rng = random.Random(1)
    ranking = LoadRanking(key=lambda load: load)
    current = {}
    for _ in range(2000):  # far more re-keys than members: stale entries pile up and get rebuilt away
        worker_id = f"w{rng.randrange(40):02d}"
        current[worker_id] = rng.randrange(10)
        ranking.set(worker_id, current[worker_id])
        if rng.random() < 0.05:
            assert list(ranking.ordered()) == sorted((k, w) for w, k in current.items())
    assert list(ranking.ordered()) == sorted((k, w) for w, k in current.items())
    first_three = []
    for pair in ranking.ordered():  # a reader that stops early leaves the ranking whole
        first_three.append(pair)
        if len(first_three) == 3:
            break
    assert first_three == sorted((k, w) for w, k in current.items())[:3]
    assert len(list(ranking.ordered())) == len(current)


def exhaustive_decode(workers, needed, pool):
    fits = [w for w in sorted(workers, key=lambda w: w.worker_id) if pool.load(w.worker_id).kv_blocks_free >= needed]
    if not fits:
        return None
    return min(fits, key=lambda w: pool.load(w.worker_id).decode_rank).worker_id  # min keeps the first (lowest id)


@pytest.mark.parametrize("seed", range(12))
def test_ranked_choices_equal_the_scans_as_loads_change(seed):
    rng = random.Random(seed)
    decode = [info(f"d{i:02d}", role="decode", kv_blocks_total=100, kv_blocks_used=rng.randrange(100))
              for i in range(rng.randint(2, 30))]
    prefill = [info(f"p{i:02d}", queued_prefill_tokens=rng.choice([0, 0, 64, 900])) for i in range(rng.randint(2, 12))]
    pool = pool_of(*decode, *prefill)
    index = PrefixIndex()
    least, kv = make_policy("least-load"), make_policy("kv-aware")
    tokens = []
    for step in range(300):
        action = rng.random()
        if action < 0.4:  # a request begins: the choices must see it at once, not at the next heartbeat
            worker = rng.choice(decode + prefill)
            tokens.append(pool.begin(worker.worker_id, rng.choice([0, 16, 300])))
        elif action < 0.7 and tokens:
            token = tokens.pop(rng.randrange(len(tokens)))
            (pool.end_prefill if rng.random() < 0.3 else pool.end)(token)
        elif action < 0.75:  # a heartbeat: new reported loads
            decode = [info(w.worker_id, role="decode", kv_blocks_total=100, kv_blocks_used=rng.randrange(100),
                           num_running=rng.randrange(4), heartbeat_at=step) for w in decode]
            pool.update(decode + prefill)
        needed = rng.choice([1, 10, 40, 95])
        want = exhaustive_decode(decode, needed, pool)
        for policy in (least, kv):
            if want is None:
                with pytest.raises(CapacityError):
                    policy.choose_decode(pool.decode_workers(), needed, pool)
            else:
                assert policy.choose_decode(pool.decode_workers(), needed, pool).worker.worker_id == want
        def least_key(w):
            load = pool.load(w.worker_id)
            return load.pending_prefill_tokens, load.num_requests, w.worker_id
        hashes = [rng.getrandbits(60) for _ in range(4)]
        assert least.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index).worker.worker_id == \
            min(prefill, key=least_key).worker_id
        want_kv = min(prefill, key=lambda w: (kv.cost(pool.load(w.worker_id), len(hashes) * BS), w.worker_id))
        assert kv.choose_prefill(pool.prefill_workers(), hashes, BS, pool, index).worker.worker_id == \
            want_kv.worker_id


def test_round_robin_decode_rotates_over_the_workers_that_fit():
    workers = [info(f"d{i}", role="decode", kv_blocks_total=100, kv_blocks_used=used)
               for i, used in enumerate([0, 90, 0, 0])]
    pool = pool_of(*workers)
    rr = make_policy("round-robin")
    picks = [rr.choose_decode(pool.decode_workers(), 20, pool).worker.worker_id for _ in range(5)]
    assert picks == ["d0", "d2", "d3", "d0", "d2"]  # d1 has 10 blocks free: skipped, the rotation goes on
    only = pool_of(*[info(f"d{i}", role="decode", kv_blocks_total=100, kv_blocks_used=used)
                     for i, used in enumerate([90, 0, 90])])
    decision = rr.choose_decode(only.decode_workers(), 20, only)
    assert (decision.worker.worker_id, decision.reason) == ("d1", "most_room")
