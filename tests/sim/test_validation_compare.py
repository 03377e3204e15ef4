"""The validation's comparison and its reference: bench routing's repeated runs read back, the simulator's
ratios set beside them per seed, and the front door's CPU fitted from /proc figures."""

import json

import pytest

from services.sim import routing_reference
from services.sim.profiles import CALIBRATION
from services.sim.validation import compare


def policy(hit, mean, p90, p99):
    return {"hit_rate": hit, "ttft_s": {"mean": mean, "p90": p90, "p99": p99, "p50": mean}}


def real(hit, mean, p90, p99):
    return {"hit_rate": hit, "ttft_mean_s": mean, "ttft_p90_s": p90, "ttft_p99_s": p99}


def test_the_ratios_means_are_compared_seed_for_seed():
    sim = {0: {"kv-aware": policy(0.9, 1.0, 2.0, 8.0), "round-robin": policy(0.45, 5.0, 8.0, 16.0)},
           1: {"kv-aware": policy(0.9, 1.0, 2.0, 8.0), "round-robin": policy(0.45, 4.0, 8.0, 10.0)},
           7: {"kv-aware": policy(0.9, 1.0, 2.0, 8.0), "round-robin": policy(0.45, 4.0, 8.0, 10.0)}}
    rl = {0: {"kv-aware": real(0.9, 1.0, 2.0, 8.0), "round-robin": real(0.5, 5.0, 8.0, 16.0)},
          1: {"kv-aware": real(0.9, 2.0, 2.0, 8.0), "round-robin": real(0.5, 5.0, 8.0, 16.0),
              "least-load": real(0.5, 6.0, 9.0, 12.0)}}
    out = compare(sim, rl)
    assert out["seeds"] == [0, 1]  # seed 7 has no real run
    r = out["ratios_kv_over_rr"]
    assert r["hit_rate"]["sim"]["mean"] == pytest.approx(2.0) and r["hit_rate"]["real"]["mean"] == pytest.approx(1.8)
    assert r["hit_rate"]["error"] == pytest.approx(2.0 / 1.8 - 1, abs=1e-3)
    assert r["hit_rate"]["within_goal"]
    # mean TTFT: simulated 0.2 and 0.25, real 0.2 and 0.4
    assert r["ttft_mean"]["sim"]["values"] == [0.2, 0.25] and r["ttft_mean"]["real"]["values"] == [0.2, 0.4]
    assert r["ttft_mean"]["error"] == pytest.approx(0.225 / 0.3 - 1, abs=1e-3) and not r["ttft_mean"]["within_goal"]
    assert r["ttft_mean"]["per_seed_error"]["values"] == [0.0, -0.375]
    lo, hi = r["ttft_mean"]["sim"]["interval_90"]
    assert 0.2 <= lo <= hi <= 0.25
    # per policy: only the seeds both sides ran (least-load: none simulated)
    assert "least-load" not in out["per_policy"]
    assert out["per_policy"]["round-robin"]["ttft_p99"] == {"sim": 13.0, "real": 16.0, "error": -0.188, "seeds": 2}


def run_file(tmp_path, name, seeds, wall_per_request, cpu_ms):
    """A saved bench routing run: every policy's summary with the /proc CPU per request."""
    repeats = []
    for seed in seeds:
        pols = {}
        for pol, wall in wall_per_request.items():
            pols[pol] = {"hit_rate": 0.5, "ttft_ms_mean": 1000.0, "ttft_ms_p90": 2000.0, "ttft_ms_p99": 3000.0,
                         "requests": 200, "wall_s": 200 * wall, "requests_per_s": 1 / wall, "handoff_ms_p50": 20.0,
                         "cpu_ms_per_request": {"router": cpu_ms(wall) / 2, "redis": cpu_ms(wall) / 4,
                                                "client": cpu_ms(wall) / 4, "prefill-0": 999.0}}
        repeats.append({"seed": seed, "policies": pols})
    path = tmp_path / name
    path.write_text(json.dumps({"bench": "routing", "result": {"repeats": repeats, "loadavg_start": [1, 1, 1]}}))
    return str(path)


def test_the_front_doors_cpu_is_split_into_per_request_and_steady_parts(tmp_path):
    def cpu_ms(wall):  # 12 ms a request, plus 0.05 of a core all along
        return 12.0 + 0.05 * wall * 1e3

    walls = {"kv-aware": 0.2, "round-robin": 0.9}
    files = [run_file(tmp_path, "a.json", [0, 1], walls, cpu_ms), run_file(tmp_path, "b.json", [2], walls, cpu_ms)]
    cal = tmp_path / "calibration.json"
    cal.write_text(CALIBRATION.read_text())
    assert routing_reference.main([*files, "--calibration", str(cal)]) == 0
    written = json.loads(cal.read_text())
    cpu = written["profiles"]["cpu"]
    assert cpu["frontdoor_cpu_s"] == pytest.approx(0.012, abs=1e-5)
    assert cpu["frontdoor_busy_cores"] == pytest.approx(0.05, abs=1e-4)
    assert cpu["transfer"]["latency_s"] == 0.0075  # the idle hop stays; the loaded hand-off is in the reference
    # the served workers' CPU over the modelled compute: the files' 999 ms of prefill CPU a request is far more
    # than the model's, their 0 ms of decode CPU far less
    assert cpu["worker_cpu_factor"]["prefill"] > 2 and cpu["worker_cpu_factor"]["decode"] == 0
    ref = written["validation_reference"]
    assert [r["seed"] for r in ref["repeats"]] == [0, 1, 2]
    assert ref["repeats"][2]["policies"]["kv-aware"] == {"hit_rate": 0.5, "ttft_mean_s": 1.0, "ttft_p90_s": 2.0,
                                                        "ttft_p99_s": 3.0, "requests_per_s": 5.0,
                                                        "prefill_cpu_ms": 999.0, "decode_cpu_ms": 0,
                                                        "other_cores": 0.0, "other_cores_estimated": True,
                                                        "loadavg": [1, 1, 1], "handoff_ms_p50": 20.0}


def test_a_seed_given_twice_or_a_run_without_cpu_figures_is_refused(tmp_path, capsys):
    walls = {"kv-aware": 0.2}
    a = run_file(tmp_path, "a.json", [0], walls, lambda w: 10.0)
    b = run_file(tmp_path, "b.json", [0], walls, lambda w: 10.0)
    cal = tmp_path / "calibration.json"
    cal.write_text("{}")
    assert routing_reference.main([a, b, "--calibration", str(cal)]) == 2
    assert "seed 0 kv-aware appears twice" in capsys.readouterr().err
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"result": {"config": {"seed": 0}, "policies": {"kv-aware": {
        "hit_rate": 0.9, "ttft_ms_mean": 1.0, "ttft_ms_p90": 1.0, "ttft_ms_p99": 1.0, "requests_per_s": 1.0,
        "requests": 1, "wall_s": 1.0}}}}))
    assert routing_reference.main([str(old), "--calibration", str(cal)]) == 2
    assert "no cpu_ms_per_request" in capsys.readouterr().err
    assert cal.read_text() == "{}"  # nothing written


def test_the_prefill_workers_cost_splits_into_a_factor_and_a_cost_per_request():
    # runs whose modelled compute differs (kv-aware's hits, round-robin's misses): 1.2 x compute + 7 ms each
    sim = [88.0, 400.0, 90.0, 350.0]
    assert routing_reference.prefill_cost_fit(sim, [1.2 * s + 7.0 for s in sim]) == pytest.approx((1.2, 7.0))
    # the same CPU whatever the compute cannot be a negative factor: the plain ratio, nothing per request
    factor, per_request = routing_reference.prefill_cost_fit(sim, [500.0] * 4)
    assert factor == pytest.approx(2000 / sum(sim), rel=1e-3) and per_request == 0.0

