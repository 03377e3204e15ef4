"""placement.place / begin_prefill: the dispatch attempt's decisions, shared with the simulator."""

import pytest

from services.errors import CapacityError
from services.router.placement import begin_decode, begin_prefill, place
from services.router.policy import RouterPolicyConfig, make_policy
from services.router.prefix_index import PrefixIndex
from tests.router.test_policy import BS, info, pool_of, prompt


def setup(**policy_options):
    pool = pool_of(info("p1"), info("p2"), info("d1", "decode"))
    config = RouterPolicyConfig(**policy_options)
    return pool, config, make_policy("kv-aware", **policy_options)


def run_place(pool, config, policy, index, tokens, hashes, disaggregation="auto"):
    return place(policy, config, disaggregation, pool, index, pool.decode_workers(), pool.prefill_workers(),
                 hashes, len(tokens), BS)


def test_disaggregated_by_default_and_local_only_where_configured():
    tokens, hashes = prompt(4 * BS)
    index = PrefixIndex()
    pool, config, policy = setup()
    p = run_place(pool, config, policy, index, tokens, hashes)
    assert p.decode.worker.worker_id == "d1" and p.prefill.worker.worker_id == "p1"
    assert run_place(pool, config, policy, index, tokens, hashes, "never").prefill is None

    # a short prompt with local prefill opted in: the decode worker computes it ...
    pool, config, policy = setup(local_prefill_max_tokens=8 * BS)
    assert run_place(pool, config, policy, index, tokens, hashes).prefill is None
    # ... unless disaggregation is forced, or the prompt is longer than the allowance
    assert run_place(pool, config, policy, index, tokens, hashes, "always").prefill.worker.worker_id == "p1"
    long_tokens, long_hashes = prompt(16 * BS)
    assert run_place(pool, config, policy, index, long_tokens, long_hashes).prefill is not None
    # what the decode worker caches counts: a long prompt it mostly holds is short enough
    index.apply("d1", [("s", long_hashes[:12])])
    assert run_place(pool, config, policy, index, long_tokens, long_hashes).prefill is None


def test_no_room_on_any_decode_worker_is_a_capacity_error():
    tokens, hashes = prompt(200 * BS)  # the decode worker has 100 blocks
    pool, config, policy = setup()
    with pytest.raises(CapacityError):
        run_place(pool, config, policy, PrefixIndex(), tokens, hashes)


def test_begin_prefill_predicts_the_cache_and_counts_uncached_tokens():
    tokens, hashes = prompt(10 * BS + 3)
    index = PrefixIndex()
    index.apply("p2", [("s", hashes[:6])])
    pool, config, policy = setup()
    p = run_place(pool, config, policy, index, tokens, hashes)
    assert (p.prefill.worker.worker_id, p.prefill.overlap_blocks) == ("p2", 6)
    token = begin_prefill(pool, index, p.prefill, hashes, len(tokens), BS)
    assert pool.load("p2").inflight_prefill_tokens == len(tokens) - 6 * BS
    assert index.overlap("p2", hashes) == len(hashes)  # the prediction: it will hold every full block
    pool.end(token)
    assert pool.load("p2").inflight_requests == 0


def test_disaggregated_requests_between_two_heartbeats_spread_over_the_decode_workers():
    # no heartbeat arrives between them, so only the router's own in-flight counts tell the decode
    # workers apart: without begin_decode all six went to d1 (the least loaded at the last beat)
    pool = pool_of(info("p1"), info("d1", "decode"), info("d2", "decode"), info("d3", "decode"))
    config, policy, index = RouterPolicyConfig(), make_policy("kv-aware"), PrefixIndex()
    chosen, tokens = [], []
    for i in range(6):
        text, hashes = prompt(4 * BS, first=1000 * i)
        p = run_place(pool, config, policy, index, text, hashes, "always")
        tokens += [begin_prefill(pool, index, p.prefill, hashes, len(text), BS), begin_decode(pool, p.decode)]
        chosen.append(p.decode.worker.worker_id)
    assert sorted(chosen) == ["d1", "d1", "d2", "d2", "d3", "d3"]
    for token in tokens:
        pool.end(token)
    assert all(pool.load(w).inflight_requests == 0 for w in ("p1", "d1", "d2", "d3"))


def test_a_prompt_the_decode_worker_holds_skips_the_prefill_worker():
    """A repeated prompt (or a conversation's next turn) whose full blocks the decode worker holds: it
    computes the rest (under a block) itself, with no prefill worker, reservation or KV hand-off."""
    tokens, hashes = prompt(6 * BS + 5)
    index = PrefixIndex()
    pool, config, policy = setup()
    assert run_place(pool, config, policy, index, tokens, hashes).prefill is not None  # nothing cached yet
    index.apply("d1", [("s", hashes[:5])])  # all but one full block: still a prefill worker's job
    assert run_place(pool, config, policy, index, tokens, hashes).prefill is not None
    index.apply("d1", [("s", hashes)])
    assert run_place(pool, config, policy, index, tokens, hashes).prefill is None
    # a prefill worker holding it too changes nothing; forced disaggregation and the switch do
    index.apply("p1", [("s", hashes)])
    assert run_place(pool, config, policy, index, tokens, hashes).prefill is None
    assert run_place(pool, config, policy, index, tokens, hashes, "always").prefill is not None
    pool, config, policy = setup(local_prefill_cached=False)
    assert run_place(pool, config, policy, index, tokens, hashes).prefill is not None
