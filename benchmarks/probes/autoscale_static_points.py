"""Probe: given static provisionings on the bench's autoscale day, does each meet 99%? The points a static
search would try, run side by side with it (a search is serial, one core; this runs the points you name).

    PYTHONPATH=. python benchmarks/probes/autoscale_static_points.py 22+8 23+7 [--rate 32] [--seed 1]
        [--shape coding] [--period-s 7200] [--router '{"load_weight": 0.1}'] [--profile h100-measured] [--bursts]

Each point runs as the bench's static search runs it (`experiments._static` with the 99% goal: a run that
has missed more than 1% of the day's requests stops early, its attainment the bound that proves the miss).
Prints, per point: attainment, whether it stopped early, and worker-hours. The h100 profile (``--profile``
another), the bench's SLOs (TTFT 2 s, ITL 50 ms) and its day (k = 12 at the default period; autoscale_day.py
builds it). ``--bursts``: each of the day's bursts judged against 99% too, as the bench's static search
judges peak provisioning (``--static-goal bursts``, its default); each burst's attainment is printed.
"""

import argparse
import json
import time

from autoscale_day import load_day_and_arrivals

from services.sim import experiments
from services.sim.metrics import SLO


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("points", nargs="+", help="P+D static provisionings")
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--shape", default="coding")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--period-s", type=float, default=7200.0)
    ap.add_argument("--router", default="{}", help="RouterPolicyConfig fields as JSON (load_weight 0.1)")
    ap.add_argument("--profile", default="h100", help="the calibration profile (default h100, the bench's)")
    ap.add_argument("--bursts", action="store_true", help="judge each of the day's bursts too (the bench's rule)")
    args = ap.parse_args()
    profile, scale, trace, arrivals = load_day_and_arrivals(args, args.period_s)
    windows = list(arrivals.bursts) if args.bursts else []
    print(f"{len(trace)} requests, {args.shape} day seed {args.seed}, rate {args.rate:g}", flush=True)
    for point in args.points:
        prefill, decode = (int(x) for x in point.split("+"))
        start = time.process_time()
        run = experiments._static(scale.profile(profile), trace, SLO(2.0, 0.05), prefill, decode,
                                  scale.heartbeat_s, goal=0.99, policy_options=json.loads(args.router), windows=windows)
        print(f"static {prefill}+{decode}: attainment {run['slo_attainment']}{experiments.bursts_text(run)}, stopped "
              f"{run.get('stopped_by', False) if run.get('stopped') else False}, "
              f"{run['worker_hours']} worker-h ({time.process_time() - start:.0f} s of CPU)", flush=True)


if __name__ == "__main__":
    main()
