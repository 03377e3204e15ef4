"""The cpu profile's validation reference and front-door load, from ``pdserve bench routing --repeats`` runs.

    python -m services.sim.routing_reference benchmarks/results/routing-A.json routing-B.json ...

reads the saved runs (``--save``), and writes into the calibration file
(``--calibration``, default ``services/sim/calibration.json``):

* ``validation_reference``: every repeat's seed and each policy's hit rate and mean,
  p90 and p99 TTFT, what ``validation.py`` compares the simulator with, and the cores
  the machine's other tenants took during that run (``other_cores``), which the
  simulator takes from the run's host (the runs share the machine with other jobs);
* the cpu profile's ``frontdoor_cpu_s`` and ``frontdoor_busy_cores`` (host.py): the
  router's, Redis's and the client's CPU from /proc over each measured run,
  fitted as ``cpu = frontdoor_cpu_s * requests + frontdoor_busy_cores * wall``
  (per request, and the heartbeats, registry reads and polls that run whether
  requests come or not), over the runs of every policy, whose request rates differ;
* its ``worker_cpu_factor``: each role's CPU per request from /proc over the engine
  compute the simulator models for the same requests (a served worker's gRPC, KV send
  and event loop beside the engine's steps): the decode worker's a ratio, the prefill
  worker's a factor and a cost per request (``prefill_per_request_s``), fitted over the
  runs of every policy (a hit sends its prompt's KV as a miss does);
* each run's median hand-off (the router's TTFT less the prefill worker's compute and
  send: dispatch, the Prefill call, the first token's way back), in the reference, to
  set beside the simulator's (the idle stack's hop, ``transfer.latency_s``, plus the
  wait for the decode worker's step under way: ``first_token_at_step``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from services.sim.profiles import CALIBRATION

FRONT_DOOR = ("router", "redis", "client")


def load_runs(paths: list[str]) -> list[dict]:
    """Every (repeat, policy) run of the files, with its file name."""
    runs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        result = data.get("result", data)
        for rep in result.get("repeats") or [{"seed": result["config"]["seed"], "policies": result["policies"]}]:
            for policy, s in rep["policies"].items():
                runs.append({"file": Path(path).name, "seed": rep["seed"], "policy": policy, "summary": s,
                             "loadavg": result.get("loadavg_start")})
    if not runs:
        raise ValueError("no bench routing runs in those files")
    return runs


def other_cores(summary: dict, host_cores: float) -> tuple[float, bool]:
    """The cores the machine's other tenants took during the run: measured (/proc/stat less the stack's
    CPU; bench routing since it records ``other_cores``), else the host's cores less what the stack used,
    which assumes the stack was CPU-bound (3 workers on 2 cores, 8 requests in flight). Second: estimated."""
    if "other_cores" in summary:
        return summary["other_cores"], False
    used = sum(summary["cpu_ms_per_request"].values()) / 1e3 * summary["requests"] / summary["wall_s"]
    return round(max(0.0, host_cores - used), 3), True


def reference(runs: list[dict], host_cores: float = 2.0) -> dict:
    repeats: dict[int, dict] = {}
    for run in runs:
        s = run["summary"]
        others, estimated = other_cores(s, host_cores) if "cpu_ms_per_request" in s else (0.0, True)
        if run["seed"] in repeats and run["policy"] in repeats[run["seed"]]:
            raise ValueError(f"seed {run['seed']} {run['policy']} appears twice; give each seed once")
        repeats.setdefault(run["seed"], {})[run["policy"]] = {
            "hit_rate": s["hit_rate"], "ttft_mean_s": s["ttft_ms_mean"] / 1e3, "ttft_p90_s": s["ttft_ms_p90"] / 1e3,
            "ttft_p99_s": s["ttft_ms_p99"] / 1e3, "requests_per_s": s["requests_per_s"],
            # the workers' CPU per request (/proc), beside the simulator's modelled compute
            "prefill_cpu_ms": round(sum(v for k, v in s.get("cpu_ms_per_request", {}).items()
                                        if k.startswith("prefill")), 2),
            "decode_cpu_ms": round(sum(v for k, v in s.get("cpu_ms_per_request", {}).items()
                                       if k.startswith("decode")), 2),
            # the simulator gives the run's stack the host's cores less these (validation.py)
            "other_cores": others, "other_cores_estimated": estimated, "loadavg": run["loadavg"],
            "handoff_ms_p50": s.get("handoff_ms_p50")}
    files = sorted({r["file"] for r in runs})
    return {"source": f"pdserve bench routing --repeats, seeds {sorted(repeats)}: {', '.join(files)}",
            "repeats": [{"seed": seed, "policies": repeats[seed]} for seed in sorted(repeats)]}


def front_door(runs: list[dict]) -> dict:
    """Least squares of the front door's CPU seconds over (requests, wall seconds), every run."""
    rows, cpu = [], []
    for run in runs:
        s = run["summary"]
        if "cpu_ms_per_request" not in s:
            raise ValueError(f"{run['file']} has no cpu_ms_per_request: run bench routing from this version")
        rows.append((s["requests"], s["wall_s"]))
        cpu.append(sum(s["cpu_ms_per_request"][p] for p in FRONT_DOOR) / 1e3 * s["requests"])
    (per_request, busy), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(cpu), rcond=None)
    return {"frontdoor_cpu_s": round(max(per_request, 0.0), 5), "frontdoor_busy_cores": round(max(busy, 0.0), 4)}


def prefill_cost_fit(sim_ms: list[float], real_ms: list[float]) -> tuple[float, float]:
    """A prefill worker's CPU per request over runs: real = factor * modelled engine compute + per request,
    in relative error (kv-aware's ~110 ms weigh as much as round-robin's ~480). Every request pays the
    per-request part (the call, the whole prompt's KV sent) whether it hit or not, so runs whose hit rates
    differ separate the two. Where they do not (a part negative, or a factor under half the engine's own
    compute: the CPU did not follow the compute), the plain ratio of the sums, none per request."""
    a, y = np.array([[s, 1.0] for s in sim_ms]), np.array(real_ms, dtype=float)
    if len(sim_ms) >= 2 and min(sim_ms) > 0 and min(real_ms) > 0:
        (factor, per_request), *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
        if factor >= 0.5 and per_request >= 0:
            return round(float(factor), 3), round(float(per_request), 2)
    return (round(float(y.sum() / a[:, 0].sum()), 3) if a[:, 0].sum() else 1.0), 0.0


def worker_cpu_factor(ref: dict, calibration: Path) -> dict:
    """A served worker's CPU per request (/proc) over the engine compute the simulator models for the
    same requests: the gRPC, KV-send and event-loop work beside the engine's steps. The decode worker's,
    a ratio (its event loop's work grows with the tokens it streams); the prefill worker's, a factor and a
    cost per request (``prefill_cost_fit``), as ``prefill_per_request_s``."""
    from services.sim.profiles import load_profile
    from services.sim.validation import simulate_bench, simulated_requests

    profile = dataclasses.replace(load_profile("cpu", calibration), worker_cpu_factor={})
    real, sim = {"prefill": [], "decode": []}, {"prefill": [], "decode": []}
    for rep in ref["repeats"]:
        policies = rep["policies"]
        runs = simulate_bench(profile, simulated_requests(rep["seed"], profile.block_size)[0], list(policies),
                              {p: r["other_cores"] for p, r in policies.items()})
        for policy, r in policies.items():
            for role in real:
                real[role].append(r[f"{role}_cpu_ms"])
                sim[role].append(runs[policy][f"{role}_cpu_ms"])
    out = {}
    if sum(sim["prefill"]):
        factor, per_request_ms = prefill_cost_fit(sim["prefill"], real["prefill"])
        out.update({"prefill": factor, "prefill_per_request_s": round(per_request_ms / 1e3, 5)})
    if sum(sim["decode"]):
        out["decode"] = round(sum(real["decode"]) / sum(sim["decode"]), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="bench routing result files (--save)")
    parser.add_argument("--calibration", default=str(CALIBRATION))
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.files)
        cal = json.loads(Path(args.calibration).read_text())
        ref = reference(runs, cal.get("profiles", {}).get("cpu", {}).get("host_cores", 2))
        fd = front_door(runs)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = Path(args.calibration)
    cpu = cal["profiles"]["cpu"]
    cpu["frontdoor_cpu_s"], cpu["frontdoor_busy_cores"] = fd["frontdoor_cpu_s"], fd["frontdoor_busy_cores"]
    cpu["source"]["frontdoor"] = (
        f"router + Redis + client CPU from /proc during pdserve bench routing's measured requests, "
        f"{len(runs)} runs ({ref['source']}), least squares over requests and wall seconds")
    cal["validation_reference"] = ref
    path.write_text(json.dumps(cal, indent=1) + "\n")
    cpu["worker_cpu_factor"] = worker_cpu_factor(ref, path)
    cpu["source"]["worker_cpu_factor"] = (
        "each role's CPU per request from /proc in the same runs over the simulator's modelled engine compute "
        "for the same requests (validation.py without the factor): decode pooled over every run; prefill "
        "fitted as factor x compute + prefill_per_request_s over the runs (relative error)")
    path.write_text(json.dumps(cal, indent=1) + "\n")
    print(json.dumps(fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
