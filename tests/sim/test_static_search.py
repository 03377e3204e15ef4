"""The static-peak search: the smallest prefill + decode meeting the goal, from a hint, in few runs.

The search is an algorithm over a monotone "meets the SLO" test; here that test is a crafted frontier
(prefill >= 5 and decode >= 3 meet 99%) so the search's own steps are what is checked.
"""

import pytest

from services.sim import experiments

FRONTIER = (5, 3)


@pytest.fixture
def calls(monkeypatch):
    runs = []

    def static(profile, requests, slo, prefill, decode, heartbeat_s=1.0, goal=None, windows=()):
        runs.append((prefill, decode))
        ok = prefill >= FRONTIER[0] and decode >= FRONTIER[1]
        return {"workers": prefill + decode, "prefill": prefill, "decode": decode,
                "slo_attainment": 1.0 if ok else 0.9, "worker_hours": float(prefill + decode)}

    monkeypatch.setattr(experiments, "_static", static)
    return runs


@pytest.mark.parametrize("hint", [(5, 3), (6, 4), (40, 20), (2, 1), (1, 1)])
def test_the_search_finds_the_smallest_provisioning_meeting_the_goal(calls, hint):
    best, runs = experiments.static_peak(None, [], None, hint)
    assert (best["prefill"], best["decode"]) == FRONTIER
    assert len(runs) == len(calls)


def test_a_hint_at_the_answer_costs_three_runs(calls):
    experiments.static_peak(None, [], None, FRONTIER)
    assert calls == [(5, 3), (4, 3), (5, 2)]  # meets; one fewer prefill fails; one fewer decode fails


def test_the_hint_is_the_planner_days_95th_percentile_not_its_peak():
    decisions = [{"prefill": 4, "decode": 2}] * 97 + [{"prefill": 60, "decode": 9}] * 3
    assert experiments.static_hint({"decisions": decisions}) == (4, 2)


def test_a_static_start_is_p_plus_d_workers_and_anything_else_is_refused():
    import argparse

    from services.sim.bench import _workers_pair

    assert _workers_pair("9+4") == (9, 4)
    for bad in ("9", "0+4", "9+-1", "a+b", "9+4+1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected P\\+D"):
            _workers_pair(bad)


def test_a_static_run_that_cannot_meet_the_goal_stops_early_and_one_that_can_is_run_whole():
    from services.sim.metrics import SLO
    from services.sim.profiles import load_profile
    from services.sim.workloads import SimRequest

    profile, slo = load_profile("h100"), SLO(2.0, 0.05)
    # 20 prompts of 8,192 tokens a second for 60 s: one prefill worker (~3 a second) falls behind at once
    reqs = [SimRequest(i, i / 20, "standard", list(range(i * 128, (i + 1) * 128)), 8192, 16) for i in range(1200)]
    short = experiments._static(profile, reqs, slo, 1, 2, goal=0.99)
    assert short["stopped"] and short["slo_attainment"] < 0.99 and short["stopped_at_s"] < 30
    whole = experiments._static(profile, reqs, slo, 12, 2, goal=0.99)
    assert "stopped" not in whole and whole == experiments._static(profile, reqs, slo, 12, 2)


def test_a_saved_search_is_reused_with_its_peak_run_again_and_refused_when_the_simulator_changed(calls):
    saved = {"static_peak": {"workers": 8, "prefill": 5, "decode": 3, "slo_attainment": 1.0, "worker_hours": 8.0},
             "static": [{"workers": 7, "prefill": 4, "decode": 3, "slo_attainment": 0.9, "worker_hours": 7.0},
                        {"workers": 8, "prefill": 5, "decode": 3, "slo_attainment": 1.0, "worker_hours": 8.0}]}
    peak, runs = experiments.recheck_static(None, [], None, saved, 1.0)
    assert calls == [(5, 3)]  # one run, not the search's three or more
    assert peak == saved["static_peak"] and runs == saved["static"]
    saved["static_peak"] = {**saved["static_peak"], "slo_attainment": 0.995}  # what an older simulator gave
    with pytest.raises(ValueError, match="simulator changed"):
        experiments.recheck_static(None, [], None, saved, 1.0)


def test_static_from_refuses_another_trace(tmp_path):
    import argparse
    import json

    from services.sim import bench

    saved = {"profile": "h100", "slo": {"ttft_s": 2.0, "itl_s": 0.05}, "seed": 1, "requests": 100_000,  # the policy part's

             "autoscale": {"trace_shape": "coding", "rate": 8.0, "period_s": 7200.0, "burst_factor": 1.5,
                           "requests": 1000, "static_peak": {"prefill": 5, "decode": 2}}}
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"result": saved}))
    args = argparse.Namespace(static_from=str(path), profile="h100", ttft_slo=2.0, itl_slo=0.05, seed=1,
                              trace_shape="coding", autoscale_rate=8.0, period_s=7200.0, burst_factor=1.5,
                              static_goal="day")
    assert bench._static_from(args, 1000)["static_peak"] == {"prefill": 5, "decode": 2}
    args.static_goal = "bursts"  # a search saved before static_goal existed judged the day alone
    with pytest.raises(ValueError, match="not this run's trace"):
        bench._static_from(args, 1000)
    args.static_goal = "day"
    args.seed = 0
    with pytest.raises(ValueError, match="not this run's trace"):
        bench._static_from(args, 1000)


def test_a_static_run_that_meets_the_day_but_drops_a_burst_does_not_meet_peak_provisioning():
    from services.sim.metrics import SLO
    from services.sim.profiles import load_profile
    from services.sim.workloads import SimRequest

    profile, slo = load_profile("h100"), SLO(2.0, 0.05)
    # 5 prompts of 1,024 tokens a second for 3,000 s (one prefill worker ~20% busy), and at t = 300 a burst of
    # 40 prompts of 8,192 tokens (~11 s of its work): the burst's requests wait past the TTFT SLO, and their
    # misses are under 1% of the day's
    steady = [SimRequest(i, i / 5, "standard", list(range(i * 16, (i + 1) * 16)), 1024, 2) for i in range(15_000)]
    burst = [SimRequest(100_000 + i, 300.0 + i / 40, "standard", list(range(10**7 + i * 128, 10**7 + (i + 1) * 128)),
                        8192, 2) for i in range(40)]
    reqs = sorted(steady + burst, key=lambda r: r.arrival)
    day = experiments._static(profile, reqs, slo, 1, 2, goal=0.99)
    assert "stopped" not in day and experiments.meets(day, 0.99)
    peak = experiments._static(profile, reqs, slo, 1, 2, goal=0.99, windows=[(300.0, 301.0)])
    assert peak["stopped"] and peak["stopped_by"] == "burst 1" and peak["slo_attainment"] < 0.5
    assert not experiments.meets(peak, 0.99) and peak["stopped_at_s"] < 400
    whole = experiments._static(profile, reqs, slo, 1, 2, windows=[(300.0, 301.0)])  # no goal: run to the end
    assert whole["slo_attainment"] == day["slo_attainment"] and whole["windows"][0]["requests"] == 45
    assert whole["windows"][0]["slo_attainment"] < 0.5 and not experiments.meets(whole, 0.99)
