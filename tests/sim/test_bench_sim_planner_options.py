"""``pdserve bench sim --parts autoscale`` runs the planner as configured: ``--planner-config`` (PlannerConfig
fields), ``--forecast-curve`` (other days' demand curves) and ``--cold-start-s`` reach every planner run and
are recorded in the result; a config or a curve that does not fit is refused with a message; ``--jobs`` runs
the day's simulations side by side and changes nothing in the result."""

import json
import subprocess
import sys

import pytest

TINY_DAY = ["--parts", "autoscale", "--period-s", "300", "--autoscale-rate", "0.2", "--planner-targets", "0.6",
            "--headline-target", "0.6", "--threshold-targets", "", "--check-trace", "", "--no-ablations", "--json"]


def _bench(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "bench", "sim", *TINY_DAY, *extra],
                          capture_output=True, text=True, timeout=300)


def _autoscale(*extra: str) -> dict:
    proc = _bench(*extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["autoscale"]


def _curve(path, seed: int, tok_s: float, rate: float = 0.2, bins: int = 60, fall: float = 0.0,
           profile: str = "h100") -> str:
    """A demand curve of the tiny day's trace (5 s bins), flat or falling by ``fall`` of its start a bin."""
    tok = [tok_s * (1 - fall * b) for b in range(bins)]
    path.write_text(json.dumps({"bin_s": 5.0, "tok_s": tok, "kv": [t / 10 for t in tok], "shape": "coding",
                                "seed": seed, "rate": rate, "profile": profile, "bursts": 2}))
    return str(path)


def test_the_planner_config_forecast_and_cold_start_reach_the_planner_and_the_result(tmp_path):
    plain = _autoscale()
    assert plain["planner_config"] == {} and plain["forecast"] is None
    assert plain["day_scale"]["real_cold_start_s"] == 120.0  # the h100 profile's

    config = {"warm_min": 0, "burst_factor": 1.0, "warm_confirm_s": 30}
    tuned = _autoscale("--planner-config", json.dumps(config), "--cold-start-s", "600")
    assert tuned["planner_config"] == config
    assert tuned["day_scale"]["real_cold_start_s"] == 600.0
    assert tuned["day_scale"]["cold_start_s"] == pytest.approx(600 / 288, abs=1e-3)  # compressed with the day
    assert tuned["headline_run"]["worker_hours_by_state"] != plain["headline_run"]["worker_hours_by_state"]

    # warm_min_ahead_s keeps the standby only while the forecast rises: without a forecast it stays all day, with
    # one that falls all day it goes
    gated = ["--planner-config", json.dumps({"warm_min_ahead_s": 3600})]
    curves = [_curve(tmp_path / f"c{seed}.json", seed, 1000.0, fall=0.015) for seed in (1, 2)]
    no_forecast, forecast = _autoscale(*gated), _autoscale(*gated, "--forecast-curve", *curves)
    assert forecast["forecast"] == {"curves": ["c1.json", "c2.json"], "tok_factor": 1.62, "kv_factor": 0.88}
    warm = [run["headline_run"]["worker_hours_by_state"]["warm"] for run in (no_forecast, forecast)]
    assert warm[1] < warm[0] / 2, warm


@pytest.mark.parametrize("extra, message", [
    (["--planner-config", '{"warm_mni": 0}'], "unknown field(s) ['warm_mni']"),
    (["--planner-config", '{"target_utilisation": 0.7}'], "set the target with --planner-targets"),
    (["--planner-config", '{"burst_factor": 0.5}'], "burst_factor must be >= 1"),
    (["--planner-config", "warm_min=0"], "--planner-config is not JSON"),
    (["--cold-start-s", "0"], "--cold-start-s must be positive"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_a_planner_config_that_does_not_fit_is_refused_with_a_message(extra, message):
    proc = _bench(*extra)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_a_curve_of_this_very_day_or_of_another_trace_is_refused(tmp_path):
    proc = _bench("--forecast-curve", _curve(tmp_path / "same.json", seed=0, tok_s=10.0))  # the run's seed is 0
    assert proc.returncode == 2 and "is foresight, not a forecast" in proc.stderr, proc.stderr[-2000:]
    proc = _bench("--forecast-curve", _curve(tmp_path / "cpu.json", seed=1, tok_s=10.0, profile="cpu"))
    assert proc.returncode == 2 and "this run's day is" in proc.stderr, proc.stderr[-2000:]
    proc = _bench("--forecast-curve", _curve(tmp_path / "short.json", seed=1, tok_s=10.0, bins=10))
    assert proc.returncode == 2 and "covers 50 s, this run's day is 300 s" in proc.stderr, proc.stderr[-2000:]
    proc = _bench("--forecast-curve", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "cannot read a demand curve" in proc.stderr, proc.stderr[-2000:]


def test_a_curve_of_the_same_trace_at_another_rate_is_a_forecast(tmp_path):
    """The planner scales the forecast to the demand it sees: a day at twice the rate can forecast from the
    curves of days at the half (the rate-64 runs in BENCHMARKS.md do), and a flat curve's level does not matter."""
    low, high = (_autoscale("--forecast-curve", _curve(tmp_path / f"r{rate}.json", seed=1, tok_s=tok, rate=rate))
                 for rate, tok in ((0.1, 10.0), (32.0, 3200.0)))
    assert low["forecast"] == {"curves": ["r0.1.json"], "tok_factor": 1.62, "kv_factor": 0.88}
    assert low["headline_run"] == high["headline_run"]  # its counts by state, pool events, attainments


def test_runs_side_by_side_give_the_runs_one_at_a_time_give():
    """``--jobs 2`` with a known static start: the headline planner, the other targets and the static
    search's points run in forked processes; every figure is the one-at-a-time run's."""
    day = ["--planner-targets", "0.6,0.8", "--threshold-targets", "0.7", "--static-start", "2+2"]
    one, two = (json.loads(proc.stdout) for proc in
                (_checked(_bench(*day, "--jobs", jobs)) for jobs in ("1", "2")))
    for out in (one, two):
        out.pop("total_wall_s")
    drop_wall = ("wall_s", "cpu_s")
    assert {k: v for k, v in one.items() if k not in drop_wall} == {k: v for k, v in two.items() if k not in drop_wall}
    auto = two["autoscale"]
    assert [r["variant"] for r in auto["planner"]] == ["target 0.6", "target 0.8"] and len(auto["threshold"]) == 1
    assert (auto["static_peak"]["prefill"], auto["static_peak"]["decode"]) != (0, 0) and auto["static"]


def _checked(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_the_lookahead_is_one_cold_start_unless_the_planner_config_sets_it():
    from services.sim.day_scale import DayScale
    from services.sim.experiments import planner_variants
    from services.sim.profiles import load_profile

    profile, scale = load_profile("h100"), DayScale(7200)  # k = 12; h100's cold start 120 s
    plain = planner_variants(profile, scale, [0.6], 0.6, ablations=True)
    assert plain["target 0.6"].lookahead_s == pytest.approx(120 / 12)
    assert plain["no lookahead"].lookahead_s == 0
    own = planner_variants(profile, scale, [0.6], 0.6, ablations=True, base={"lookahead_s": 300, "warm_min": 2})
    assert own["target 0.6"].lookahead_s == pytest.approx(300 / 12) and own["target 0.6"].warm_min == 2
    assert own["no warm pool"].warm_min == 0 and own["no warm pool"].lookahead_s == pytest.approx(300 / 12)
