"""Probe: a day's demand read from its trace alone, no simulation: per bin of the simulated day, the prompt
tokens a prefill worker must compute a second and the KV blocks the decode workers hold. It stands in for a
recorded day's planner signals (``autoscale_timeline.py``: ~an hour of CPU a day at 32 session starts/s; this,
~2 min), so a forecast can be learned from other days (``autoscale_foresight.py --curve``).

* computed tokens: a request's prompt less its longest prefix of blocks any earlier request of the day sent
  (a cache as large as the day; the cluster's caches are per worker and evict, so it computes more);
* KV blocks: a request holds its prompt and half its output from 0.3 s after it arrives for ``--step-s`` a
  token (a decode step's time at the day's batches).

``--compare TIMELINE.jsonl`` prints, per 100 s, the recorded signals (``tok_s``, ``kv``) over this estimate:
the factors that turn the estimate into the planner's units.

    PYTHONPATH=. python benchmarks/probes/autoscale_demand_curve.py coding 0 --rate 32 --profile h100-measured \
        --out curve-seed0.json [--compare benchmarks/results/sim-autoscale-timeline-...jsonl]
"""

import argparse
import json
from collections import defaultdict

from autoscale_day import add_day_arguments, load_day_and_arrivals


def demand_curve(trace, block_size: int, bin_s: float, step_s: float, period_s: float) -> dict:
    bins = int(period_s / bin_s) + 1
    tok, kv = [0.0] * bins, [0.0] * bins
    seen: set[int] = set()
    for r in sorted(trace, key=lambda r: r.arrival):
        hit = 0
        for h in r.hashes:
            if h not in seen:
                break
            hit += 1
        seen.update(r.hashes)
        b = min(int(r.arrival / bin_s), bins - 1)
        tok[b] += max(r.num_tokens - hit * block_size, 0) / bin_s
        blocks = (r.num_tokens + r.out_tokens / 2) / block_size
        t, end = r.arrival + 0.3, r.arrival + 0.3 + r.out_tokens * step_s
        while t < end and int(t / bin_s) < bins:  # the blocks held, spread over the bins they span
            b = int(t / bin_s)
            upto = min(end, (b + 1) * bin_s)
            kv[b] += blocks * (upto - t) / bin_s
            t = upto
    return {"bin_s": bin_s, "step_s": step_s, "tok_s": [round(x, 1) for x in tok], "kv": [round(x, 1) for x in kv]}


def compare(curve: dict, timeline: str) -> None:
    rows = [json.loads(line) for line in open(timeline)]
    by = defaultdict(list)
    for row in rows:
        by[int(row["t"] // 100)].append(row)
    n = int(100 / curve["bin_s"])
    print(f"{'from s':>7}{'tok_s recorded':>16}{'estimate':>10}{'ratio':>7}{'kv recorded':>13}{'estimate':>10}{'ratio':>7}")
    for b in sorted(by):
        tok = sum(r["tok_s"] for r in by[b]) / len(by[b])
        kv = sum(r["kv"] for r in by[b]) / len(by[b])
        et = sum(curve["tok_s"][b * n:(b + 1) * n]) / n
        ek = sum(curve["kv"][b * n:(b + 1) * n]) / n
        print(f"{b * 100:>7}{tok:>16.0f}{et:>10.0f}{tok / max(et, 1):>7.2f}{kv:>13.0f}{ek:>10.0f}{kv / max(ek, 1):>7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_day_arguments(ap, rate=32.0)
    ap.add_argument("--out", required=True, help="where to write the curve (JSON)")
    ap.add_argument("--bin-s", type=float, default=5.0, help="the curve's bin, simulated seconds (5)")
    ap.add_argument("--step-s", type=float, default=0.025, help="a decode step's time, s (0.025)")
    ap.add_argument("--compare", help="a timeline's JSON lines (autoscale_timeline.py) to print against")
    args = ap.parse_args()
    if not (args.bin_s > 0 and args.step_s > 0):
        ap.error("--bin-s and --step-s must be > 0")
    profile, scale, trace, arrivals = load_day_and_arrivals(args)
    curve = demand_curve(trace, profile.block_size, args.bin_s, args.step_s, scale.period_s)
    curve.update(shape=args.shape, seed=args.seed, rate=args.rate, profile=args.profile, bursts=arrivals.bursts)
    with open(args.out, "w") as f:
        json.dump(curve, f)
    print(f"{args.shape} seed {args.seed}: {len(trace)} requests, curve of {len(curve['tok_s'])} bins to {args.out}")
    if args.compare:
        compare(curve, args.compare)


if __name__ == "__main__":
    main()
