"""Probe: read autoscale_timeline.py's JSON lines and say where the day's TTFT misses were and what the
prefill demand did: the misses by the state of the ticks they came in (a scale-down in the 20 ticks before,
workers still starting, the warm pool empty), the computed prompt tokens per arriving request by the ready
prefill workers' utilisation, and the ticks around the one with the most misses.

    PYTHONPATH=. python benchmarks/probes/autoscale_timeline_summary.py timeline.jsonl [more.jsonl ...] [--excerpt 40]
"""

import argparse
import collections
import json

from services.sim.autoscale import capacity_of
from services.sim.profiles import load_profile

PREFILL_TOKENS_PER_S = capacity_of(load_profile("h100")).prefill_tokens_per_s  # one prefill worker, as the planner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--excerpt", type=int, default=0, help="ticks shown before the most-missed one (0: none)")
    ap.add_argument("--around", type=float, nargs=2, default=None, metavar=("FROM_S", "TO_S"),
                    help="show the ticks of this span instead")
    args = ap.parse_args()
    for name in args.files:
        rows = [json.loads(line) for line in open(name) if line.startswith("{")]
        tick = rows[1]["t"] - rows[0]["t"]
        print(f"== {name}: {len(rows)} ticks of {tick:.2f} s, {sum(r['missed'] for r in rows)} TTFT misses by "
              f"arrival tick")
        states = collections.Counter()
        for i, r in enumerate(rows):
            if r["missed"]:
                past = rows[max(0, i - 20):i]
                states[("scale-down before" if any(p["prefill"] < p["p_active"] for p in past) else "-",
                        "starting" if r["p_starting"] else "-", "warm pool empty" if r["warm"] == 0 else "-")] += r["missed"]
        for key, n in states.most_common():
            print(f"  misses in ticks {' / '.join(key)}: {n}")
        reasons = collections.Counter(part.split(" ")[0] for r in rows for part in r["reason"].split("; "))
        print(f"  decision reasons (ticks): {dict(reasons)}")
        bins = collections.defaultdict(lambda: [0, 0.0])
        for r in rows[30:]:
            ready = r["p_active"] - r["p_starting"]
            if ready <= 0 or not r["arrived"]:
                continue
            util = r["tok_s"] / (ready * PREFILL_TOKENS_PER_S)
            b = bins[min(int(util * 10), 12)]
            b[0] += 1
            b[1] += r["tok_s"] / (r["arrived"] / tick)
        print("  ready prefill utilisation -> computed prompt tokens per arriving request (ticks)")
        for k in sorted(bins):
            n, per = bins[k]
            print(f"    {k / 10:.1f}-{(k + 1) / 10:.1f}: {per / n:6.0f} ({n})")
        if args.excerpt or args.around:
            worst = max(range(len(rows)), key=lambda i: rows[i]["missed"])
            shown = ([r for r in rows if args.around[0] <= r["t"] <= args.around[1]] if args.around
                     else rows[max(0, worst - args.excerpt):worst + 3])
            print(f"  ticks {shown[0]['t']:.0f}-{shown[-1]['t']:.0f} s (t, prefill active / starting -> decided, "
                  "computed tokens/s, queued tokens, arrivals, misses, warm / warm target, reason)")
            for r in shown:
                print(f"    {r['t']:8.2f} P {r['p_active']:3d} {r['p_starting']:2d} -> {r['prefill']:3d} "
                      f"{r['tok_s']:7d} {r['queued']:8d} {r['arrived']:4d} {r['missed']:4d} {r['warm']:2d} "
                      f"{r['warm_target']:2d} {r['reason'][:60]}")


if __name__ == "__main__":
    main()
