"""Probe: why the planner's decode count stands over its KV need, from the timeline probe's JSON lines
(``autoscale_timeline.py``). Over a span of the day: the KV need each tick read (KV blocks in use over one
worker's blocks at ``kv_target``), the need of the planner's level (the trend window's mean less its highest
and lowest window), the count decided and its reasons, and the lag-1 autocorrelation of the KV about its
least-squares line in each trend window (the planner's trend test takes the windows as independent).

    PYTHONPATH=. python benchmarks/probes/autoscale_decode_noise.py timeline.jsonl --from 2880 --to 3300 \
        --profile h100-measured
"""

import argparse
import json
import math
import statistics
from collections import Counter

from services.planner.policy import PlannerConfig, lag1_autocorrelation
from services.sim.day_scale import DayScale
from services.sim.profiles import load_profile


def lag1(ys: list[float]) -> float:
    """The lag-1 autocorrelation of ``ys`` about their least-squares line (windows evenly spaced)."""
    n = len(ys)
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys)) / var
    return lag1_autocorrelation([y - mean_y - slope * (x - mean_x) for x, y in enumerate(ys)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--from", dest="start", type=float, default=0.0)
    ap.add_argument("--to", dest="end", type=float, default=math.inf)
    ap.add_argument("--profile", default="h100-measured")
    ap.add_argument("--period-s", type=float, default=7200.0)
    args = ap.parse_args()
    config = PlannerConfig()
    window_s = DayScale(args.period_s).s(config.trend_window_s)
    per_worker = load_profile(args.profile).kv_blocks * config.kv_target
    rows = [json.loads(line) for line in open(args.timeline) if line.startswith("{")]
    ts, kv = [r["t"] for r in rows], [r["kv"] for r in rows]
    levels, rhos = [], []
    for i, t in enumerate(ts):
        w = [kv[j] for j in range(i + 1) if ts[j] >= t - window_s]
        # the planner's level (Planner._ahead): the trend window's mean less its highest and lowest window
        levels.append((sum(w) - max(w) - min(w)) / (len(w) - 2) if len(w) > 3 else kv[i])
        if args.start <= t < args.end and len(w) > 4:
            rhos.append(lag1(w))
    span = [i for i, t in enumerate(ts) if args.start <= t < args.end]
    need = [kv[i] / per_worker for i in span]
    level = [levels[i] / per_worker for i in span]
    print(f"{len(span)} ticks from {args.start:g} s to {min(args.end, ts[-1]):g} s; one decode worker's KV at "
          f"kv_target {config.kv_target}: {per_worker:.0f} blocks")
    print(f"  KV need per tick: mean {statistics.mean(need):.2f}, sd {statistics.stdev(need):.2f}, "
          f"tick to tick sd {statistics.stdev([b - a for a, b in zip(need, need[1:])]):.2f}, "
          f"range {min(need):.2f}-{max(need):.2f}")
    print(f"  the level's need: mean {statistics.mean(level):.2f}, range {min(level):.2f}-{max(level):.2f}; "
          f"ceil: {dict(sorted(Counter(math.ceil(x) for x in level).items()))}")
    decided = [rows[i]["decode"] for i in span]
    print(f"  decode decided: mean {statistics.mean(decided):.2f}; {dict(sorted(Counter(decided).items()))}")
    reasons = Counter(x.rstrip("0123456789. s").strip() for i in span for x in rows[i]["reason"].split("; "))
    print(f"  reasons (ticks): {dict(reasons.most_common())}")
    over = [i for i in span if rows[i]["decode"] > math.ceil(levels[i] / per_worker) + 1]
    print(f"  ticks with decode over the level's need + 1: {len(over)}, of them 'rising demand' "
          f"{sum('rising demand' in rows[i]['reason'] for i in over)}")
    every = Counter(x.rstrip("0123456789. s").strip() for r in rows for x in r["reason"].split("; "))
    print(f"  reasons over the whole file (ticks): {dict(every.most_common())}")
    print(f"  KV's lag-1 autocorrelation about each trend window's line: median {statistics.median(rhos):.2f} "
          f"(a window of n ticks then holds about n x (1 - rho) / (1 + rho) independent ones)")


if __name__ == "__main__":
    main()
