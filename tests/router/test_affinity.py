"""Session affinity: the same key keeps its worker, spills when it is overloaded, and a
worker that leaves moves only its own sessions; a worker holding more of the prompt wins."""

from collections import Counter

import pytest

from services.router.affinity import HashRing, SessionAffinity, load_bound
from services.router.placement import place
from services.router.policy import RouterPolicyConfig, make_policy
from services.router.prefix_index import PrefixIndex
from tests.router.test_policy import BS, info, pool_of, prompt

DECODE = [info(f"decode-{i}", "decode") for i in range(4)]


def decode_choice(policy, pool, key, exclude=(), hashes=(), index=None, workers=None):
    return policy.choose_decode(workers or pool.decode_workers(), 4, pool, exclude, session_key=key,
                                block_hashes=hashes, index=index)


def test_the_same_key_keeps_its_decode_worker_while_load_moves_elsewhere():
    pool, policy = pool_of(*DECODE), make_policy("kv-aware")
    first = decode_choice(policy, pool, "conversation-7")
    assert first.reason == "affinity"
    others = [w.worker_id for w in DECODE if w.worker_id != first.worker.worker_id]
    tokens = []
    for i in range(60):
        # other sessions come and go on the other workers; this one's turns keep their worker
        tokens.append(pool.begin(others[i % 3]))
        if len(tokens) > 5:
            pool.end(tokens.pop(0))
        assert decode_choice(policy, pool, "conversation-7").worker == first.worker


def test_keys_spread_over_the_workers():
    pool, policy = pool_of(*DECODE), make_policy("kv-aware")
    owners = Counter(decode_choice(policy, pool, f"user-{k}").worker.worker_id for k in range(400))
    assert set(owners) == {w.worker_id for w in DECODE}
    assert all(60 <= n <= 140 for n in owners.values()), owners  # 100 each on average


def test_an_overloaded_owner_spills_to_the_next_worker_on_the_ring_and_gets_its_sessions_back():
    pool, policy = pool_of(*DECODE), make_policy("kv-aware")
    key = "hot-session"
    walk = list(policy.affinity.ring("decode", [w.worker_id for w in DECODE]).walk(key))
    owner = walk[0]
    assert decode_choice(policy, pool, key).worker.worker_id == owner
    held = []
    for _ in range(10):
        if decode_choice(policy, pool, key).worker.worker_id != owner:
            break
        held.append(pool.begin(owner))
    # four idle workers: one request on the owner already reaches ceil(1.25 * (1 + 1) / 4) = 1
    assert len(held) == 1 and load_bound([1, 0, 0, 0], 1.25) == 1
    spilled = decode_choice(policy, pool, key)
    assert (spilled.worker.worker_id, spilled.reason) == (walk[1], "affinity_spill")
    pool.end(held.pop())
    assert decode_choice(policy, pool, key).worker.worker_id == owner


def test_the_load_factor_sets_how_far_above_the_mean_an_owner_may_go():
    assert load_bound([0, 0, 0, 0], 1.25) == 1  # an idle cluster: everyone takes one
    assert load_bound([10, 10, 10, 10], 1.25) == 13  # 1.25 x the mean with this request
    assert load_bound([10, 10, 10, 10], 1.0) == 11
    with pytest.raises(ValueError, match="affinity_load_factor"):
        RouterPolicyConfig(affinity_load_factor=0.9)
    with pytest.raises(ValueError, match="affinity_override_blocks"):
        RouterPolicyConfig(affinity_override_blocks=0)
    with pytest.raises(ValueError, match=">= 1"):
        SessionAffinity(0.5)


def test_a_worker_leaving_moves_only_its_own_sessions():
    workers = [f"decode-{i}" for i in range(5)]
    keys = [f"conv-{k}" for k in range(1000)]
    before = {k: next(HashRing(workers).walk(k)) for k in keys}
    after = {k: next(HashRing(workers[:2] + workers[3:]).walk(k)) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "decode-2" for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == "decode-2")
    assert len({after[k] for k in moved}) >= 3  # its sessions spread over the others

    # the same through the policy: the pool loses decode-2 and only its keys change worker
    pool, policy = pool_of(*DECODE), make_policy("kv-aware")
    owners = {k: decode_choice(policy, pool, k).worker.worker_id for k in keys[:300]}
    pool.update([w for w in DECODE if w.worker_id != "decode-2"])
    for k, was in owners.items():
        now = decode_choice(policy, pool, k).worker.worker_id
        assert now == was or was == "decode-2"
        assert now != "decode-2"


def test_a_worker_excluded_for_one_request_does_not_move_other_keys():
    pool, policy = pool_of(*DECODE), make_policy("kv-aware")
    keys = [f"conv-{k}" for k in range(200)]
    owners = {k: decode_choice(policy, pool, k).worker.worker_id for k in keys}
    for k in keys:
        d = decode_choice(policy, pool, k, exclude={"decode-1"})
        assert d.worker.worker_id == owners[k] or owners[k] == "decode-1"


def test_a_decode_worker_holding_more_of_the_prompt_wins_unless_it_is_overloaded():
    pool, policy = pool_of(*DECODE), make_policy("kv-aware")
    tokens, hashes = prompt(8 * BS)
    key = "conversation-2"
    owner = decode_choice(policy, pool, key, hashes=hashes, index=PrefixIndex()).worker.worker_id
    holder = next(w.worker_id for w in DECODE if w.worker_id != owner)
    index = PrefixIndex()
    index.apply(owner, [("s", hashes[:3])])
    index.apply(holder, [("s", hashes[:5])])
    d = decode_choice(policy, pool, key, hashes=hashes, index=index)
    assert (d.worker.worker_id, d.reason, d.overlap_blocks) == (holder, "prefix_hit", 5)
    # the holder is over the load bound: the cache is not worth piling onto it
    held = [pool.begin(holder) for _ in range(3)]
    d = decode_choice(policy, pool, key, hashes=hashes, index=index)
    assert (d.worker.worker_id, d.reason) == (owner, "affinity")
    for t in held:
        pool.end(t)


def test_every_policy_honours_the_key():
    for name in ("least-load", "round-robin"):
        pool, policy = pool_of(*DECODE), make_policy(name)
        assert len({decode_choice(policy, pool, "same").worker.worker_id for _ in range(8)}) == 1


def test_the_prefill_choice_ignores_the_key():
    # kv-aware already follows a conversation's prefix on prefill workers (it records each choice in
    # its index at once) and weighs that cache against the queue: a key would only unbalance them
    prefill = [info(f"prefill-{i}") for i in range(3)]
    pool, policy = pool_of(*prefill), make_policy("kv-aware")
    tokens, hashes = prompt(8 * BS)
    index = PrefixIndex()
    index.apply("prefill-1", [("s", hashes)])
    decode = [info(f"decode-{i}", "decode") for i in range(2)]
    pool.update(prefill + decode)
    for key in ("", "conversation-4", "conversation-5", "another"):
        placement = place(policy, policy.config, "always", pool, index, pool.decode_workers(), pool.prefill_workers(),
                          hashes, len(tokens), BS, session_key=key)
        assert (placement.prefill.worker.worker_id, placement.prefill.reason) == ("prefill-1", "prefix_hit")
        assert placement.decode.reason == ("affinity" if key else "least_load")


def test_more_of_the_prompt_means_at_least_override_blocks_more_leading_blocks():
    pool = pool_of(*DECODE)
    tokens, hashes = prompt(10 * BS)
    key = "conversation-6"
    policy = make_policy("kv-aware")
    owner = decode_choice(policy, pool, key).worker.worker_id
    other = next(w.worker_id for w in DECODE if w.worker_id != owner)
    index = PrefixIndex()
    index.apply(owner, [("s", hashes[:6])])
    index.apply(other, [("s", hashes[:6])])
    # as much as the key's worker: a tie is no reason to move
    assert decode_choice(policy, pool, key, hashes=hashes, index=index).worker.worker_id == owner
    index.apply(other, [("s", hashes[6:7])])  # one leading block more
    d = decode_choice(policy, pool, key, hashes=hashes, index=index)
    assert (d.worker.worker_id, d.reason, d.overlap_blocks) == (other, "prefix_hit", 7)
    # a margin of 2 blocks: one more is not enough, two are
    strict = make_policy("kv-aware", affinity_override_blocks=2)
    assert decode_choice(strict, pool, key, hashes=hashes, index=index).worker.worker_id == owner
    index.apply(other, [("s", hashes[7:8])])
    assert decode_choice(strict, pool, key, hashes=hashes, index=index).worker.worker_id == other
    # blocks that do not continue the prompt's leading run do not count
    index.apply(owner, [("s", hashes[8:10])])
    assert decode_choice(strict, pool, key, hashes=hashes, index=index).worker.worker_id == other
