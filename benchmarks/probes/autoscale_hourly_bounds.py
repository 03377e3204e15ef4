"""Probe: the figures BENCHMARKS.md draws from autoscale_hourly.py's runs (the collected result file): each run's
workers per role averaged over the day's hours, and, for a static run, perfect foresight by hour (fractional
workers following the day hour by hour: each role's mean hourly load over its peak hour's) by requests, by the
prefill workers' busy share and by KV use, with the bursts' request rate against the peak hour's.

    python benchmarks/probes/autoscale_hourly_bounds.py benchmarks/results/sim-autoscale-hourly-rate32-20261127.json
"""

import argparse
import json


def ratio(xs: list[float]) -> float:
    return round(sum(xs) / len(xs) / max(xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    args = ap.parse_args()
    runs = json.load(open(args.file))["result"]["runs"]
    for name, run in runs.items():
        hours, total = run["hours"], run["total"]
        prefill = sum(h["prefill_workers"] for h in hours) / len(hours)
        decode = sum(h["decode_workers"] for h in hours) / len(hours)
        print(f"{name}: attainment {total['attainment']}, {total['worker_hours']} worker-h; workers per hour on "
              f"average: prefill {prefill:.2f}, decode {decode:.2f}")
        if run["args"]["kind"] != "static":
            continue
        p, d = (int(x) for x in run["args"]["what"].split("+"))
        busy = ratio([h["prefill_busy_share"] for h in hours])
        kv = ratio([h["kv_usage"] for h in hours])
        hour_s = 7200 / 24  # the autoscale day's hour (k = 12)
        peak = max(h["requests"] for h in hours) / hour_s * 10
        bursts = ", ".join(f"{b['requests']} (at {b['start_s']:.0f} s)" for b in total.get("bursts", []))
        print(f"  perfect foresight by hour: requests {ratio([h['requests'] for h in hours])}, prefill busy {busy}, "
              f"KV {kv}, both roles weighted by {p}+{d}: {(p * busy + d * kv) / (p + d):.3f}")
        print(f"  the peak hour's requests per 10 s: {peak:.0f}; the bursts' in their 10 s: {bursts}")


if __name__ == "__main__":
    main()
