"""Where a planner run's worker-hours go, over the day, against perfect foresight's curve.

Reads a saved ``pdserve bench sim --parts autoscale --save`` result. Prints the headline planner's
worker-hours by state (serving, starting and draining per role; warm standbys; standbys still
loading) and, per tenth of the day, its mean prefill and decode counts and warm pool beside the
ideal count: the static peak's workers scaled by the arrival rate then over the day's highest
(the trace's bursts re-drawn from its seed), which is what ``ideal_worker_hours_vs_static`` sums.
Then, per role, the workers its scale-ups added over the day by the first reason their decision gave
(a TTFT or ITL boost, the queue lag, the rising trend, else the demand).

Usage: PYTHONPATH=. python benchmarks/probes/autoscale_breakdown.py RESULT.json
"""

import argparse
import json
from pathlib import Path

from services.sim import experiments
from services.sim.day_scale import DayScale
from services.sim.profiles import load_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--buckets", type=int, default=10)
    args = ap.parse_args()
    result = json.loads(Path(args.result).read_text())["result"]
    auto, profile = result["autoscale"], load_profile(result["profile"])
    run, peak = auto["headline_run"], auto["static_peak"]
    print(f"{auto['trace_shape']} day, seed {auto['seed']}, k = {auto['day_scale']['k']:.0f}: headline planner "
          f"{run['variant']}: {run['worker_hours']} worker-h, attainment {run['slo_attainment']}; static peak "
          f"{peak['prefill']}+{peak['decode']} = {peak['worker_hours']} worker-h; ideal "
          f"{auto['ideal_worker_hours_vs_static']} of it = "
          f"{auto['ideal_worker_hours_vs_static'] * peak['worker_hours']:.2f} worker-h")
    for state, hours in run["worker_hours_by_state"].items():
        print(f"  {state:<17}{hours:>8.3f} worker-h  {hours / peak['worker_hours']:.3f} of static")
    _, arrivals = experiments.diurnal_day(auto["seed"], profile, auto["rate"], DayScale(auto["period_s"]),
                                          auto["trace_shape"], auto["burst_factor"])
    top = max(arrivals.rate_at(arrivals.duration_s * (i + 0.5) / 10_000) for i in range(10_000))
    span = auto["period_s"] / args.buckets
    print(f"{'from s':>7}{'prefill':>9}{'decode':>8}{'warm':>7}{'ideal':>8}  (mean counts; ideal = static "
          f"{peak['workers']} x rate / peak rate)")
    for b in range(args.buckets):
        ds = [d for d in run["decisions"] if b * span <= d["t"] < (b + 1) * span]
        if not ds:
            continue
        ideal = sum(peak["workers"] * arrivals.rate_at(b * span + span * (i + 0.5) / 100) / top
                    for i in range(100)) / 100
        print(f"{b * span:>7.0f}{sum(d['prefill'] for d in ds) / len(ds):>9.1f}"
              f"{sum(d['decode'] for d in ds) / len(ds):>8.1f}"
              f"{sum(d['warm'] + d['warming'] for d in ds) / len(ds):>7.1f}{ideal:>8.1f}")
    for role in ("prefill", "decode"):
        added: dict[str, list[int]] = {}  # reason -> [scale-ups, workers added]
        for before, d in zip(run["decisions"], run["decisions"][1:]):
            if d[role] > before[role]:
                reason = next((r for key, r in (("TTFT", "TTFT boost"), ("ITL", "ITL boost"), ("queue lag", "queue lag"),
                                                ("rising", "rising demand")) if key in d["reason"]), "demand")
                a = added.setdefault(reason, [0, 0])
                a[0], a[1] = a[0] + 1, a[1] + d[role] - before[role]
        print(f"  {role} scale-ups by reason (scale-ups, workers added): {added}")


if __name__ == "__main__":
    main()
