"""The HPA-like threshold rule alone on one autoscale day, as ``pdserve bench sim`` runs it (``--threshold-targets``),
without the planner run and the static search a bench run must make first: its attainment over the day and in each
burst, its worker-hours, against a given static minimum's worker-hours.

    PYTHONPATH=. python benchmarks/probes/autoscale_threshold_day.py coding 1 68.031 0.5 0.7 --rate 64 \\
        --profile h100-measured --cold-start-s 33.5 [--jobs 2]

``--jobs``: the targets side by side, each in a process forked from this one (``experiments.DayRuns``).
"""

import argparse
import time

from services.sim import experiments
from services.sim.day_scale import DayScale
from services.sim.metrics import SLO
from services.sim.profiles import load_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(experiments.TRACE_SHAPES))
    ap.add_argument("seed", type=int)
    ap.add_argument("static_worker_hours", type=float, help="static's minimum on this day (a bench run's)")
    ap.add_argument("targets", type=float, nargs="+", help="the rule's target utilisations")
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--cold-start-s", type=float)
    ap.add_argument("--period-s", type=float, default=7200.0)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    profile, scale = load_profile(args.profile, cold_start_s=args.cold_start_s), DayScale(args.period_s)
    trace, arrivals = experiments.diurnal_day(args.seed, profile, args.rate, scale, args.shape)
    slo, started = SLO(2.0, 0.05), time.perf_counter()
    with experiments.DayRuns(scale.profile(profile), trace, slo, args.jobs) as runs:
        pending = [(t, runs.submit(experiments._autoscaled, scale, "threshold", threshold=t,
                                   windows=list(arrivals.bursts))) for t in args.targets]
        for target, run in pending:
            r = run.get()
            print(f"{args.shape} seed {args.seed} {profile.name} rate {args.rate:g} threshold rule {target}: "
                  f"attainment {r['slo_attainment']}{experiments.bursts_text(r)}, {r['worker_hours']} worker-h = "
                  f"{r['worker_hours'] / args.static_worker_hours:.3f} of static, peak {r['peak']}, "
                  f"wall {time.perf_counter() - started:.0f} s", flush=True)
            print(f"  by state {r['worker_hours_by_state']}", flush=True)


if __name__ == "__main__":
    main()
