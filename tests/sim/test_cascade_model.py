"""``pdserve bench cascade``'s model (services/sim/cascade.py): the escalated share follows the threshold,
cost and latency follow the escalated share between the all-small and all-large ends (plus the probe's
waste), and the quality curve has RouteLLM's area."""

from __future__ import annotations

import argparse
import math

import pytest

from services.sim import cascade
from services.sim.profiles import load_profile

CONFIDENCES = [("easy", -0.05), ("easy", -0.2), ("hard", -0.9), ("hard", -1.7)]


@pytest.fixture(scope="module")
def tiers():
    large = load_profile("h100")
    return (cascade.Tier.of(cascade.scaled(large, 0.154), 1020, 129, 32), cascade.Tier.of(large, 1020, 129, 32))


def test_the_threshold_sets_the_escalated_share_and_the_easy_prompts_go_last(tiers):
    rows = [cascade.evaluate(*tiers, CONFIDENCES, t, 8, 129) for t in (-math.inf, -1.0, -0.5, -0.1, math.inf)]
    assert [r["escalated"] for r in rows] == [0, 0.25, 0.5, 0.75, 1]
    assert [r["escalated_easy"] for r in rows] == [0, 0, 0, 0.5, 1]
    assert [r["escalated_hard"] for r in rows] == [0, 0.5, 1, 1, 1]
    costs = [r["cost_vs_large"] for r in rows]
    assert costs == sorted(costs)
    assert rows[0]["cost_vs_small"] == 1  # never escalating costs what the small tier alone does
    assert costs[-1] > 1  # always escalating wastes the probe on top of the large tier
    e2e = [r["e2e_mean_s"] for r in rows]
    assert e2e == sorted(e2e)
    assert rows[0]["ttft_mean_s"] < rows[-1]["ttft_mean_s"]


def test_quality_runs_from_the_small_to_the_large_tier_with_routellms_area():
    assert cascade.pgr_routellm(0) == 0 and cascade.pgr_routellm(1) == 1
    n = 10_000
    area = sum(cascade.pgr_routellm((i + 0.5) / n) for i in range(n)) / n
    assert area == pytest.approx(cascade.ROUTELLM_APGR, abs=1e-3)


def test_the_bench_reads_the_measured_confidences():
    args = argparse.Namespace(profile="h100", calibration=None, small_scale=0.154, prompt_tokens=1020,
                              output_tokens=129, batch=32, signal="mean", tokens=8, thresholds=[-0.5])
    result = cascade.run(args)
    assert result["confidence"]["prompts"] == 36 and result["confidence"]["easy"] == 16
    assert [r["threshold"] for r in result["rows"]] == ["-inf", -0.5, "inf"]
    assert result["rows"][0]["escalated"] == 0 and result["rows"][-1]["escalated"] == 1
    with pytest.raises(ValueError, match="first 16 tokens"):
        cascade.run(argparse.Namespace(**{**vars(args), "tokens": 17}))
