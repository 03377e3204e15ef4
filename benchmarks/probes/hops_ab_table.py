"""The table of a ``hops_ab.sh`` run: one column per run, in the order they ran (base, mine, mine, base).

Reads OUT_DIR/ab-<side>-<HHMMSS>.json (the bench's ``--json`` output) and prints, per run, the cached
TTFT p50 / p90 at each level, one user's served and engine-alone tok/s with their ratio, each process's
CPU ms per served token, and the load at the run's end; then each side's median of the served/engine
ratios. Usage: python benchmarks/probes/hops_ab_table.py OUT_DIR
"""

import json
import statistics
import sys
from pathlib import Path


def main(out: str) -> None:
    runs = sorted(Path(out).glob("ab-*.json"), key=lambda p: p.stem.rsplit("-", 1)[1])
    cols = []
    for path in runs:
        side = path.stem.split("-")[1]
        try:
            cols.append((side, json.loads(path.read_text())))
        except ValueError:
            cols.append((side, None))  # a run that failed or timed out wrote no JSON
    print("| | " + " | ".join(f"{side} {sum(s == side for s, _ in cols[:k + 1])}" for k, (side, _) in enumerate(cols))
          + " |")
    print("|---" * (len(cols) + 1) + "|")
    levels = sorted({c for _, r in cols if r for c in r["levels"]}, key=int)
    for c in levels:
        cells = [f"{r['levels'][c]['pdserve']['ttft_ms_p50']:.1f} / {r['levels'][c]['pdserve']['ttft_ms_p90']:.1f}"
                 if r and c in r["levels"] else "-" for _, r in cols]
        print(f"| cached TTFT p50 / p90, {c} stream(s) (ms) | " + " | ".join(cells) + " |")
    b1 = [r.get("batch1") if r else None for _, r in cols]
    print("| batch 1: served / engine alone (tok/s) | " + " | ".join(
        f"{b['served_tok_s_p50']} / {b['engine_tok_s_p50']}" if b else "-" for b in b1) + " |")
    print("| served over engine | " + " | ".join(f"{b['served_over_engine']:.3f}" if b else "-" for b in b1) + " |")
    names = sorted({n for b in b1 if b for n in b["cpu_ms_per_token"]})
    for n in names:
        print(f"| CPU ms per served token: {n} | " + " | ".join(
            f"{b['cpu_ms_per_token'].get(n, float('nan')):.3f}" if b else "-" for b in b1) + " |")
    print("| load average at the end | " + " | ".join(str(r["loadavg_1m_end"]) if r else "-" for _, r in cols) + " |")
    for side in ("base", "mine"):
        ratios = [b["served_over_engine"] for (s, _), b in zip(cols, b1) if s == side and b]
        served = [b["served_tok_s_p50"] for (s, _), b in zip(cols, b1) if s == side and b]
        if ratios:
            print(f"{side}: served over engine median {statistics.median(ratios):.3f}, served tok/s median "
                  f"{statistics.median(served):.1f} ({len(ratios)} runs)")


if __name__ == "__main__":
    main(sys.argv[1])
