"""The always-on per-phase breakdown of an engine thread: after requests, ``pdserve_phase_seconds``
has counts for every step phase the requests went through, under the engine's role label, and
the phases tile the engine loop (their sums never exceed the loop's)."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from services import phases
from services.engine.async_engine import AsyncEngine
from services.engine.sampling_params import SamplingParams


def phase_stats(role: str) -> dict[str, tuple[float, float]]:
    """phase -> (count, sum) of ``pdserve_phase_seconds{role}`` as /metrics shows it."""
    out: dict[str, list[float]] = {}
    for metric in REGISTRY.collect():
        if metric.name != "pdserve_phase_seconds":
            continue
        for s in metric.samples:
            if s.labels.get("role") != role:
                continue
            entry = out.setdefault(s.labels["phase"], [0.0, 0.0])
            if s.name.endswith("_count"):
                entry[0] = s.value
            elif s.name.endswith("_sum"):
                entry[1] = s.value
    return {k: (c, t) for k, (c, t) in out.items()}


def loop_sum(role: str) -> float:
    return REGISTRY.get_sample_value("pdserve_engine_loop_seconds_sum", {"role": role}) or 0.0


def test_requests_leave_counts_in_every_step_phase(tiny_engine):
    role = "decode"  # a label the dashboard reads; this test owns its engine thread's series only by delta
    before = phase_stats(role)
    loop_before = loop_sum(role)
    async_engine = AsyncEngine(tiny_engine(), role=role)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run():
        # two concurrent prompts: prefill steps, then decode steps; the second arrives mid-decode (mixed)
        first = asyncio.ensure_future(collect(async_engine, list(range(20, 60)), params, "p1"))
        await asyncio.sleep(0.05)
        second = await collect(async_engine, list(range(100, 140)), params, "p2")
        return await first, second

    try:
        outs = asyncio.run(asyncio.wait_for(run(), 60))
        # the loop observes after publishing; let the thread finish an idle wait so idle counts
        asyncio.run(asyncio.sleep(0.2))
    finally:
        async_engine.shutdown()
    assert all(sum(len(o.new_token_ids) for o in out) == 6 for out in outs)

    after = phase_stats(role)
    grew = {name: after[name][0] - before.get(name, (0, 0))[0] for name in after}
    for name in ("schedule", "forward_prefill", "forward_decode", "sample", "postprocess", "publish",
                 "commands", "idle"):
        assert grew.get(name, 0) > 0, f"phase {name} recorded nothing: {grew}"
    assert set(after) <= set(phases.STEP_PHASES) | set(phases.REQUEST_PHASES[role])
    step_time = sum(after[n][1] - before.get(n, (0, 0))[1] for n in after if n in phases.STEP_PHASES)
    loop_time = loop_sum(role) - loop_before
    assert 0 < step_time <= loop_time


def test_a_phase_is_recorded_even_when_its_block_raises():
    before = phase_stats("engine").get("sample", (0, 0))[0]
    try:
        with phases.phase("sample"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert phase_stats("engine")["sample"][0] == before + 1


async def collect(async_engine, prompt, params, request_id):
    return [out async for out in async_engine.generate(prompt, params, request_id=request_id)]
