"""The autoscaling trade-off plot from a ``pdserve bench sim --parts autoscale`` progress log.

For a run stopped before its JSON and plots were written: the log's lines ("planner <variant>:
attainment A, W worker-h", "threshold rule target T: ...", "static P+D: ...") hold every point.
The static peak is the smallest static run meeting 99% in the log (``--static`` adds one from
another log). Draws with services/sim/plots.py's trade-off function.

Usage: PYTHONPATH=. python benchmarks/probes/autoscale_tradeoff_from_log.py LOG OUT.png [--static P+D:A:W]
"""

import argparse
import re
import tempfile
from pathlib import Path

from services.sim.plots import _pyplot, _tradeoff

PLANNER = re.compile(r"planner (.+?): attainment ([\d.]+), ([\d.]+) worker-h")
THRESHOLD = re.compile(r"threshold rule target ([\d.]+): attainment ([\d.]+), ([\d.]+) worker-h")
STATIC = re.compile(r"static (\d+)\+(\d+): attainment ([\d.]+), ([\d.]+) worker-h")


def parse(text: str, extra_static: list[str]) -> dict:
    planner = [{"variant": v, "slo_attainment": float(a), "worker_hours": float(w),
                "target_utilisation": float(v.split()[1]) if v.startswith("target") else None}
               for v, a, w in PLANNER.findall(text)]
    threshold = [{"target": float(t), "slo_attainment": float(a), "worker_hours": float(w)}
                 for t, a, w in THRESHOLD.findall(text)]
    static = [{"prefill": int(p), "decode": int(d), "workers": int(p) + int(d), "slo_attainment": float(a),
               "worker_hours": float(w)} for p, d, a, w in STATIC.findall(text)]
    for s in extra_static:
        pd, a, w = s.split(":")
        p, d = pd.split("+")
        static.append({"prefill": int(p), "decode": int(d), "workers": int(p) + int(d), "slo_attainment": float(a),
                       "worker_hours": float(w)})
    peak = min((s for s in static if s["slo_attainment"] >= 0.99), key=lambda s: s["workers"])
    shape = re.search(r"(\d+) requests, (\w+) day", text)
    return {"static": static, "static_peak": peak, "planner": planner, "threshold": threshold,
            "requests": int(shape.group(1)) if shape else "", "trace_shape": shape.group(2) if shape else ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("out")
    ap.add_argument("--static", action="append", default=[], metavar="P+D:ATTAINMENT:WORKER_HOURS")
    args = ap.parse_args()
    autoscale = parse(Path(args.log).read_text(), args.static)
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(_tradeoff(_pyplot(), autoscale, Path(tmp), "sim"))
        Path(args.out).write_bytes(written.read_bytes())
    print(f"static peak {autoscale['static_peak']['prefill']}+{autoscale['static_peak']['decode']} = "
          f"{autoscale['static_peak']['worker_hours']} worker-h; wrote {args.out}")


if __name__ == "__main__":
    main()
