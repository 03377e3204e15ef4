"""Continuous batching on a real engine (dummy:tiny, fp32): token budget, chunked
prefill, the running-sequence cap, priorities, preemption by recompute, aborts.

Batching must never change a greedy result, so every scenario compares its
tokens with the same prompts run one at a time in an identical engine. Every
test ends with the leak check.
"""

from __future__ import annotations

import random

import pytest

from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError
from tests.engine.checks import StepLog, assert_no_leaks, generate, generate_alone, run, tokens

GREEDY = dict(temperature=0, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(2, 512) for _ in range(n)] for i, n in enumerate(lengths)}


@pytest.fixture
def reference(tiny_engine):
    """Same weights, roomy cache, default budgets: prompts run alone here."""
    return tiny_engine(num_blocks=512)


def test_token_budget_per_step_is_respected(tiny_engine, reference):
    engine = tiny_engine(max_num_batched_tokens=24)
    log = StepLog(engine)
    prompts = prompts_of([40, 7, 30, 3, 18])
    params = SamplingParams(max_tokens=6, **GREEDY)

    outs = generate(engine, prompts, params)

    assert all(sum(step.values()) <= 24 for step in log.steps)
    assert any(sum(step.values()) == 24 for step in log.steps)  # the budget was the binding limit
    assert {rid: tokens(o) for rid, o in outs.items()} == generate_alone(reference, prompts, params)
    assert all(o[-1].finish_reason == "length" and o[-1].num_output_tokens == 6 for o in outs.values())
    assert_no_leaks(engine)


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(tiny_engine, reference):
    engine = tiny_engine(max_num_batched_tokens=64, long_prefill_chunk=16)
    log = StepLog(engine)
    short, long = prompts_of([10, 100]).values()
    params_short = SamplingParams(max_tokens=20, **GREEDY)
    params_long = SamplingParams(max_tokens=3, **GREEDY)

    engine.add_request("short", short, params_short)
    first = engine.step()  # short is prefilled and decoding before the long prompt arrives
    engine.add_request("long", long, params_long)
    outs = run(engine)
    outs["short"][:0] = first

    assert log.of("long") == [16] * 6 + [4] + [1, 1]  # 100 prompt tokens, then 2 decodes
    prefill_steps = [s for s in log.steps if s.get("long", 0) > 1]
    assert len(prefill_steps) == 7
    assert all(s.get("short") == 1 for s in prefill_steps)  # the decode ran in every chunk's step
    # the long request's first token appears only once its whole prompt is in the cache
    first_long = next(o for o in outs["long"] if o.new_token_ids)
    assert first_long.num_computed_tokens == 100

    assert tokens(outs["short"]) == generate_alone(reference, {"short": short}, params_short)["short"]
    assert tokens(outs["long"]) == generate_alone(reference, {"long": long}, params_long)["long"]
    assert_no_leaks(engine)


def test_running_sequences_are_capped_by_max_num_seqs(tiny_engine, reference):
    engine = tiny_engine(max_num_seqs=2)
    log = StepLog(engine)
    prompts = prompts_of([12, 5, 20, 9, 3])
    params = SamplingParams(max_tokens=5, **GREEDY)

    outs = generate(engine, prompts, params)

    assert max(len(s) for s in log.steps) == 2
    assert max(log.running_after) == 2
    assert len(outs) == 5
    assert {rid: tokens(o) for rid, o in outs.items()} == generate_alone(reference, prompts, params)
    assert_no_leaks(engine)


def test_lower_priority_value_runs_first_when_capacity_is_short(tiny_engine):
    engine = tiny_engine(max_num_seqs=1)
    prompts = prompts_of([8, 8, 8, 8])
    params = SamplingParams(max_tokens=3, **GREEDY)
    # arrival order: bulk, urgent, normal-a, normal-b
    for rid, prio in zip(("bulk", "urgent", "normal-a", "normal-b"), (5, 0, 2, 2)):
        engine.add_request(rid, prompts[f"r{len(engine.requests)}"], params, priority=prio)

    finish_order = []
    while engine.has_unfinished():
        finish_order += [o.request_id for o in engine.step() if o.finished]

    # priority first, arrival order among equals
    assert finish_order == ["urgent", "normal-a", "normal-b", "bulk"]
    assert_no_leaks(engine)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_preemption_by_recompute_keeps_greedy_tokens(tiny_engine, reference, prefix_caching):
    # 15 usable blocks (240 tokens) for 8 requests that need 4-5 blocks each
    engine = tiny_engine(num_blocks=16, enable_prefix_caching=prefix_caching)
    prompts = prompts_of([10, 40, 25, 33, 17, 38, 12, 29], seed=1)
    params = SamplingParams(max_tokens=30, **GREEDY)
    reqs = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
        reqs[rid] = engine.requests[rid]

    outs = run(engine)

    assert engine.stats()["num_preemptions"] > 0
    assert sum(r.num_preemptions for r in reqs.values()) == engine.stats()["num_preemptions"]
    got = {rid: tokens(o) for rid, o in outs.items()}
    assert all(len(t) == 30 for t in got.values())  # no token lost or repeated by the recompute
    assert got == generate_alone(reference, prompts, params)
    assert_no_leaks(engine)


def test_preemption_evicts_the_lowest_priority_request(tiny_engine, reference):
    # 8 usable blocks; each request grows to 80 tokens (5 blocks): both cannot stay
    engine = tiny_engine(num_blocks=9)
    prompts = {"bulk": prompts_of([20], seed=2)["r0"], "vip": prompts_of([20], seed=3)["r0"]}
    params = SamplingParams(max_tokens=60, **GREEDY)
    engine.add_request("bulk", prompts["bulk"], params, priority=1)  # arrives first
    engine.add_request("vip", prompts["vip"], params, priority=0)
    reqs = {rid: engine.requests[rid] for rid in prompts}

    outs = run(engine)

    assert reqs["vip"].num_preemptions == 0
    assert reqs["bulk"].num_preemptions > 0
    assert {rid: tokens(o) for rid, o in outs.items()} == generate_alone(reference, prompts, params)
    assert_no_leaks(engine)


def test_abort_waiting_request(tiny_engine, reference):
    engine = tiny_engine(max_num_seqs=1)
    prompts = prompts_of([10, 10])
    params = SamplingParams(max_tokens=8, **GREEDY)
    engine.add_request("r0", prompts["r0"], params)
    engine.add_request("r1", prompts["r1"], params)
    first = engine.step()
    assert engine.stats()["num_waiting"] == 1

    assert engine.abort("r1") is True
    assert engine.stats()["num_waiting"] == 0
    outs = run(engine)

    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in outs["r1"]] == [(True, "abort", [])]
    assert tokens(first + outs["r0"]) == generate_alone(reference, {"r0": prompts["r0"]}, params)["r0"]
    assert engine.abort("r1") is False  # already gone
    assert_no_leaks(engine)


def test_abort_running_request_frees_its_blocks(tiny_engine, reference):
    engine = tiny_engine()
    prompts = prompts_of([40, 20])
    params = SamplingParams(max_tokens=30, **GREEDY)
    outs = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    for _ in range(5):
        for o in engine.step():
            outs[o.request_id].append(o)
    survivor = engine.requests["r1"]
    assert engine.block_pool.num_used > len(survivor.block_ids)

    engine.abort("r0")

    assert engine.block_pool.num_used == len(survivor.block_ids)
    for rid, o in run(engine).items():
        outs[rid] += o
    assert outs["r0"][-1].finish_reason == "abort" and outs["r0"][-1].new_token_ids == []
    assert len(tokens(outs["r0"])) == 5  # nothing after the abort
    assert tokens(outs["r1"]) == generate_alone(reference, {"r1": prompts["r1"]}, params)["r1"]
    assert_no_leaks(engine)


def test_abort_in_the_middle_of_a_chunked_prefill(tiny_engine):
    engine = tiny_engine(long_prefill_chunk=16)
    engine.add_request("r0", prompts_of([100])["r0"], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    engine.step()
    assert engine.block_pool.num_used == 2
    engine.abort("r0")
    outs = run(engine)
    assert outs["r0"][-1].finish_reason == "abort"
    assert_no_leaks(engine)


def test_prompt_at_the_context_limit_is_rejected(tiny_engine):
    engine = tiny_engine(num_blocks=9)  # 8 usable blocks: a 128-token context
    assert engine.max_model_len == 128
    with pytest.raises(InvalidRequestError, match="128 tokens"):
        engine.add_request("r0", [5] * 128, SamplingParams(max_tokens=1))
    assert_no_leaks(engine)


def test_prompt_that_needs_the_whole_cache_is_served(tiny_engine, reference):
    engine = tiny_engine(num_blocks=9)  # 8 usable blocks: a 128-token context
    prompt = prompts_of([120])["r0"]  # 120 + 8 output tokens fill all 8 blocks
    params = SamplingParams(max_tokens=8, **GREEDY)

    engine.add_request("r0", prompt, params)
    outs = run(engine, max_steps=200)

    assert outs["r0"][-1].finish_reason == "length"
    assert tokens(outs["r0"]) == generate_alone(reference, {"r0": prompt}, params)["r0"]
    assert_no_leaks(engine)
