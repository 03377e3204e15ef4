"""How far one run's TTFT statistics move by chance: a bootstrap of each bench routing run's own requests.

Why the validation compares mean and p90 TTFT and only reports p99: resampling a run's
200 per-request TTFTs (``ttft_ms`` in the saved JSON) with replacement gives each
statistic's spread from the luck of which requests were slow. The p99 of 200 requests
rests on the 2-3 slowest (for kv-aware: the cold opening burst), so its interval is
wide; the mean's and the p90's are narrow. Prints, per policy, the median over the runs
of each statistic's 90% interval width relative to its value, and the same for the
kv-aware / round-robin ratio (both policies resampled).

Usage: PYTHONPATH=. python benchmarks/probes/ttft_statistic_stability.py routing-*.json [--json OUT]
"""

import argparse
import json
import random
from pathlib import Path

from services.bench.stats import mean, percentile

STATS = {"mean": mean, "p90": lambda v: percentile(v, 90), "p99": lambda v: percentile(v, 99)}


def width(draws: list[float], value: float) -> float:
    return (percentile(draws, 95) - percentile(draws, 5)) / value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    per_policy: dict[str, dict[str, list[float]]] = {}
    ratio: dict[str, list[float]] = {k: [] for k in STATS}
    for path in args.files:
        result = json.loads(Path(path).read_text())["result"]
        for rep in result["repeats"]:
            samples = {p: s["ttft_ms"] for p, s in rep["policies"].items()}
            for policy, ttft in samples.items():
                for name, stat in STATS.items():
                    draws = [stat(rng.choices(ttft, k=len(ttft))) for _ in range(args.resamples)]
                    per_policy.setdefault(policy, {}).setdefault(name, []).append(width(draws, stat(ttft)))
            kv, rr = samples.get("kv-aware"), samples.get("round-robin")
            if kv and rr:
                for name, stat in STATS.items():
                    draws = [stat(rng.choices(kv, k=len(kv))) / stat(rng.choices(rr, k=len(rr)))
                             for _ in range(args.resamples)]
                    ratio[name].append(width(draws, stat(kv) / stat(rr)))
    out = {"relative_interval_90_width_median_over_runs": {
        **{p: {k: round(percentile(v, 50), 3) for k, v in s.items()} for p, s in per_policy.items()},
        "ratio kv-aware / round-robin": {k: round(percentile(v, 50), 3) for k, v in ratio.items() if v}},
        "runs": {p: len(s["mean"]) for p, s in per_policy.items()}, "files": [Path(f).name for f in args.files]}
    for who, s in out["relative_interval_90_width_median_over_runs"].items():
        print(f"{who:<30} " + "  ".join(f"{k} ±{v / 2:.0%}" for k, v in s.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
