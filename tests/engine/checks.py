"""Helpers shared by the engine tests: run requests to completion, watch steps, check for leaks."""

from __future__ import annotations

from collections import defaultdict

from services.engine.engine import Engine
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams


def assert_no_leaks(engine: Engine) -> None:
    """The lifecycle leak check: no request left behind, every KV block free again."""
    assert not engine.requests, f"requests left behind: {sorted(engine.requests)}"
    assert not engine.has_unfinished()
    assert engine.block_pool.num_used == 0, f"{engine.block_pool.num_used} KV blocks still in use"
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    assert engine.kv.num_claimed_blocks == 0, "blocks still announced as being computed"
    assert engine.kv.num_restoring == 0, "restores from the spill tier still in flight"
    spill = engine.block_pool.spill
    if spill is not None:
        assert spill.num_pinned == 0, f"{spill.num_pinned} spill slots still pinned by a restore"
        spill.check()  # every slot held, free or pinned, exactly once
        both = set(spill.hashes()) & set(engine.block_pool.cached)
        assert not both, f"{len(both)} blocks cached in both tiers"


def drain(engine: Engine) -> None:
    """Abort whatever a failed test left behind, so the next test starts clean."""
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def run(engine: Engine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle; request id -> its outputs in order. Fails instead of looping forever."""
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs[o.request_id].append(o)
    raise AssertionError(f"engine still busy after {max_steps} steps: {engine.stats()}")


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outputs)


def generate(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams,
             **add_kwargs) -> dict[str, list[RequestOutput]]:
    """Add every prompt at once, run to completion."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params, **add_kwargs)
    return run(engine)


def generate_alone(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Each prompt in an otherwise idle engine: the reference for batching-independence checks."""
    return {rid: tokens(generate(engine, {rid: ids}, params)[rid]) for rid, ids in prompts.items()}


class StepLog:
    """Records, per engine step, which request ran how many tokens (wraps the scheduler)."""

    def __init__(self, engine: Engine):
        self.steps: list[dict[str, int]] = []
        self.running_after: list[int] = []  # scheduler.num_running after each schedule()
        self.preempted: list[list[str]] = []
        schedule = engine.scheduler.schedule
        scheduler = engine.scheduler

        def recording_schedule():
            out = schedule()
            if out:
                self.steps.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
                self.running_after.append(scheduler.num_running)
            self.preempted.append(list(out.preempted))
            return out

        engine.scheduler.schedule = recording_schedule

    def of(self, request_id: str) -> list[int]:
        """Tokens scheduled for one request, per step it ran in."""
        return [s[request_id] for s in self.steps if request_id in s]
