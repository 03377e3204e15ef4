"""Probe: does compressing the planner's noise filters with the day decide the autoscaling result?

``bench sim`` compresses every time measured against the day by k = 86,400 / period_s
(services/sim/day_scale.py). The tick (the signal window), trend window, hysteresis and boost
spacing also filter the request-level noise, which is not compressed: at k = 48 a 0.2 s window
holds k times fewer requests than a real 10 s one. This runs one planner setting on the same
compressed day with those four filters compressed by a smaller factor (the cold start, lookahead
and bursts stay compressed by k) and prints attainment and worker-hours beside k's.

    python benchmarks/probes/autoscale_filter_compression.py --filter-k 48,12,4 --target 0.9
"""

from __future__ import annotations

import argparse
import dataclasses

from services.sim import experiments as ex
from services.sim.autoscale import SimAutoscaler
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.day_scale import REAL_DAY_S, DayScale
from services.sim.metrics import SLO, summarize
from services.sim.profiles import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--period-s", type=float, default=1800.0)
    p.add_argument("--shape", default="coding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--filter-k", default="48,12,4", help="compressions of tick, trend window, hysteresis, boost")
    args = p.parse_args()
    profile, scale, slo = load_profile("h100"), DayScale(args.period_s), SLO(2.0, 0.05)
    requests, _ = ex.diurnal_day(args.seed, profile, args.rate, scale, args.shape, 1.5)
    day = scale.profile(profile)
    base = ex.planner_variants(profile, scale, [args.target], args.target, False)[f"target {args.target}"]
    for k in (float(x) for x in args.filter_k.split(",")):
        f = DayScale(REAL_DAY_S / k)
        config = dataclasses.replace(base, down_after_s=f.s(300.0), trend_window_s=f.s(120.0), boost_every_s=f.s(30.0))
        sim = ClusterSim(ClusterConfig(day, 1, 1, heartbeat_s=f.heartbeat_s), ex._fresh(requests))
        scaler = SimAutoscaler("planner", day, slo, interval_s=f.tick_s, planner_config=config)
        scaler.attach(sim)
        sim.run()
        s = summarize(sim, slo)
        print(f"filters compressed {k:g}x (tick {f.tick_s:.2f} s, hysteresis {config.down_after_s:.1f} s): "
              f"attainment {s['slo_attainment']}, {scaler.worker_seconds / 3600:.3f} worker-h, peak prefill "
              f"{max(d['prefill'] for d in scaler.decisions)}, decode {max(d['decode'] for d in scaler.decisions)}",
              flush=True)


if __name__ == "__main__":
    main()
