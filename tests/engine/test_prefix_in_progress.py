"""Requests that share a prefix nobody has computed yet (a burst behind one system prompt).

The first one admitted computes the prefix; the others wait until its blocks are
cached, then hit them and compute only their own suffix, whatever arrives in the
same step. A wait ends when the prefix is cached or its computing request goes
away (abort, preemption), so nothing is left waiting forever. Every test
compares greedy tokens with the prompts run alone and ends with the leak check
(every block free, no block still announced as being computed).
"""

from __future__ import annotations

import random

import pytest

from services.engine.sampling_params import SamplingParams
from tests.engine.checks import StepLog, assert_no_leaks, generate_alone, run, tokens

GREEDY = dict(temperature=0, ignore_eos=True)
BS = 16


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


PREFIX = words(96, seed=10)  # 6 full blocks
PROMPTS = {"a": PREFIX + words(20, seed=11), "b": PREFIX + words(9, seed=12), "c": PREFIX + words(30, seed=13)}


@pytest.fixture
def chunked(tiny_engine):
    """(engine computing prompts 32 tokens per step (the prefix takes 3 steps), a reference engine
    with room to run each prompt alone, a log of the engine's steps)."""
    engine = tiny_engine(long_prefill_chunk=32)
    return engine, tiny_engine(num_blocks=512), StepLog(engine)


def prompt_tokens_run(log: StepLog, rid: str, num_outputs: int) -> int:
    """Tokens a request computed for its prompt (its steps before the decode steps)."""
    steps = log.of(rid)
    return sum(steps[: len(steps) - (num_outputs - 1)])


def test_burst_on_an_uncached_prefix_computes_it_once(chunked):
    engine, reference, log = chunked
    params = SamplingParams(max_tokens=5, **GREEDY)
    for rid, ids in PROMPTS.items():  # all in the same step
        engine.add_request(rid, ids, params)

    engine.step()
    # b and c wait for a's prefix: only a's uncomputed prompt and their own suffixes count as queued
    assert engine.stats()["num_waiting"] == 2
    assert engine.stats()["queued_prefill_tokens"] == (len(PROMPTS["a"]) - 32) + 9 + 30
    outs = run(engine)

    assert outs["a"][-1].num_cached_tokens == 0
    for rid in ("b", "c"):
        assert outs[rid][-1].num_cached_tokens == len(PREFIX)
        assert prompt_tokens_run(log, rid, len(outs[rid])) == len(PROMPTS[rid]) - len(PREFIX)
    assert engine.block_pool.prefix_hits == 2 * len(PREFIX) // BS
    assert {rid: tokens(o) for rid, o in outs.items()} == generate_alone(reference, PROMPTS, params)
    assert_no_leaks(engine)


def test_prefill_only_burst_hits_the_prefix_and_frees_every_block(tiny_engine):
    # a prefill worker: requests are prefill-only and hold their blocks until released
    engine = tiny_engine(long_prefill_chunk=32)
    params = SamplingParams(max_tokens=1, **GREEDY)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, params, prefill_only=True)

    outs = run(engine)

    assert {rid: o[-1].finish_reason for rid, o in outs.items()} == dict.fromkeys(PROMPTS, "prefilled")
    assert {rid: o[-1].num_cached_tokens for rid, o in outs.items()} == {"a": 0, "b": 96, "c": 96}
    # the prefix's blocks are shared, not copied
    assert outs["b"][-1].block_ids[:6] == outs["a"][-1].block_ids[:6] == outs["c"][-1].block_ids[:6]
    for rid in PROMPTS:
        engine.release(rid)
    assert_no_leaks(engine)


def test_a_waiting_request_does_not_hold_up_unrelated_ones(chunked):
    engine, reference, log = chunked
    params = SamplingParams(max_tokens=3, **GREEDY)
    prompts = {"a": PROMPTS["a"], "b": PROMPTS["b"], "other": words(40, seed=20)}
    for rid, ids in prompts.items():  # b arrives before other
        engine.add_request(rid, ids, params)

    outs = run(engine)

    assert log.steps[0] == {"a": 32, "other": 32}  # other was admitted past the waiting b
    assert outs["b"][-1].num_cached_tokens == len(PREFIX)
    assert {rid: tokens(o) for rid, o in outs.items()} == generate_alone(reference, prompts, params)
    assert_no_leaks(engine)


def test_waiting_request_proceeds_when_the_computing_one_is_aborted(chunked):
    engine, reference, log = chunked
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("a", PROMPTS["a"], params)
    engine.add_request("b", PROMPTS["b"], params)
    engine.step()  # a computed the prefix's first 2 blocks; b waits
    assert log.steps == [{"a": 32}]

    engine.abort("a")
    outs = run(engine)

    # b hits what a had cached and computes the rest of the prefix itself
    assert outs["b"][-1].num_cached_tokens == 32
    assert prompt_tokens_run(log, "b", len(outs["b"])) == len(PROMPTS["b"]) - 32
    assert tokens(outs["b"]) == generate_alone(reference, {"b": PROMPTS["b"]}, params)["b"]
    assert_no_leaks(engine)


def test_waiting_request_proceeds_when_the_computing_one_is_preempted(tiny_engine):
    # 9 usable blocks. "long" (priority 0) decodes and grows; "a" (priority 2) computes the
    # prefix one block per step and is preempted for long's growth; "b" (priority 1) arrives
    # while a computes the prefix, waits for it, and takes over when a is preempted.
    engine = tiny_engine(num_blocks=10, long_prefill_chunk=16)
    reference = tiny_engine(num_blocks=512)
    log = StepLog(engine)
    prompts = {"long": words(40, seed=30), "a": PREFIX + words(4, seed=31), "b": PREFIX + words(8, seed=32)}
    params = {"long": SamplingParams(max_tokens=60, **GREEDY), "a": SamplingParams(max_tokens=2, **GREEDY),
              "b": SamplingParams(max_tokens=2, **GREEDY)}
    engine.add_request("long", prompts["long"], params["long"], priority=0)
    engine.add_request("a", prompts["a"], params["a"], priority=2)
    outs = run_steps(engine, 2)
    engine.add_request("b", prompts["b"], params["b"], priority=1)
    reqs = {rid: engine.requests[rid] for rid in prompts}
    for rid, o in run_steps(engine, 1).items():
        outs.setdefault(rid, []).extend(o)
    assert "b" not in log.steps[-1]  # b waits for a's blocks

    for rid, o in run(engine).items():
        outs.setdefault(rid, []).extend(o)

    assert reqs["a"].num_preemptions == 1 and reqs["long"].num_preemptions == 0
    assert len(log.steps) == len(log.preempted)  # every step ran something: the two logs line up
    after = log.steps[next(i for i, p in enumerate(log.preempted) if "a" in p) + 1:]
    # once a let go of the prefix, b was admitted (when long had left room) and computed it;
    # a then waited for b's blocks and computed only its own 4 tokens
    assert next(i for i, s in enumerate(after) if "b" in s) < next(i for i, s in enumerate(after) if "a" in s)
    assert outs["a"][-1].num_cached_tokens == len(PREFIX)
    assert prompt_tokens_run(StepLogView(after), "a", 2) == 4
    assert {rid: tokens(o) for rid, o in outs.items()} == {
        rid: generate_alone(reference, {rid: ids}, params[rid])[rid] for rid, ids in prompts.items()}
    assert_no_leaks(engine)


class StepLogView:
    def __init__(self, steps: list[dict[str, int]]):
        self.steps = steps

    def of(self, rid: str) -> list[int]:
        return [s[rid] for s in self.steps if rid in s]


def run_steps(engine, n: int) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(n):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_identical_prompts_share_every_full_block(chunked):
    engine, reference, log = chunked
    params = SamplingParams(max_tokens=4, **GREEDY)
    prompt = PROMPTS["a"]  # 116 tokens: 7 full blocks
    for rid in ("x", "y"):
        engine.add_request(rid, prompt, params)

    outs = run(engine)

    assert outs["y"][-1].num_cached_tokens == 7 * BS
    assert prompt_tokens_run(log, "y", len(outs["y"])) == len(prompt) - 7 * BS
    assert tokens(outs["x"]) == tokens(outs["y"]) == generate_alone(reference, {"x": prompt}, params)["x"]
    assert_no_leaks(engine)
