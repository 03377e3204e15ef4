"""The planner's trade-off on one day from ``planner_config_probe.py`` logs: every configuration run on that day
(worker-hours over static's minimum against the day's SLO attainment), marked by whether it met 99% in each
burst too, beside the static points of a saved ``pdserve bench sim`` result of the same day. The bench's own
trade-off plot shows the targets one bench run swept; the configurations searched across sessions are in the
probes' logs.

    PYTHONPATH=. python benchmarks/probes/autoscale_tradeoff_from_probe_logs.py --seed 1 --rate 64 \\
        --bench benchmarks/results/sim-RUN.json --out PNG LOG...

Each result line is taken with the ``$ ...`` command line before it (its ``--rate``); labels name what a run's
configuration sets beyond ``--base`` (the thirty-third session's configuration by default).
"""

import argparse
import ast
import json
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULT = re.compile(r"^coding seed (\d+) (\S+) (\{.*\}): attainment ([\d.]+), burst 1 ([\d.]+), burst 2 ([\d.]+), "
                    r"([\d.]+) worker-h")
BASE = {"warm_confirm_s": 30, "burst_factor": 1.0, "warm_min_ahead_s": 1800, "lookahead_s": 120,
        "held_level_recent": True, "lag_target_s": 2.0}
SHORT = {"target_utilisation": "prefill", "kv_target": "KV", "down_after_s": "hold", "warm_min": "standby",
         "down_hold_recent": "down-hold", "lookahead_s": "lookahead"}
PRINTED_ONLY = ("cold_start_s", "forecast")  # the probe prints these in its config; they are not PlannerConfig's


def runs_in(path: str, seed: int, rate: float) -> list[dict]:
    out, run_rate = [], None
    for line in open(path):
        if line.startswith("$ "):
            m = re.search(r"--rate (\S+)", line)
            run_rate = float(m.group(1)) if m else 8.0  # the probe's default
            continue
        m = RESULT.match(line)
        if not m or int(m.group(1)) != seed or run_rate != rate:
            continue
        config = ast.literal_eval(m.group(3))  # the probe prints a Python dict
        out.append({"config": {k: v for k, v in config.items() if k not in PRINTED_ONLY},
                    "day": float(m.group(4)), "bursts": (float(m.group(5)), float(m.group(6))),
                    "worker_hours": float(m.group(7)), "log": path.rsplit("/", 1)[-1]})
    return out


def label(config: dict, base: dict) -> str:
    parts = [SHORT.get(k, k) if v is True else f"{SHORT.get(k, k)} {v}" for k, v in config.items() if base.get(k) != v]
    return ", ".join(parts) or "reference"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=64.0)
    ap.add_argument("--bench", required=True, help="a saved bench sim result of the same day: its static points")
    ap.add_argument("--base", default=json.dumps(BASE), help="the configuration labels are relative to (JSON)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    auto = json.load(open(args.bench))["result"]["autoscale"]
    static_wh = auto["static_peak"]["worker_hours"]
    base = json.loads(args.base)
    runs, seen = [], set()
    for path in args.logs:
        for run in runs_in(path, args.seed, args.rate):
            key = (json.dumps(run["config"], sort_keys=True), run["worker_hours"])
            if key not in seen:  # a run repeated in a later log (the reference) is one point
                seen.add(key)
                runs.append(run)
    head = auto["headline_run"]
    fig, (ax, key) = plt.subplots(1, 2, figsize=(10, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})
    print(f"static minimum {auto['static_peak']['prefill']}+{auto['static_peak']['decode']}: {static_wh} worker-h; "
          + "; ".join(f"static {r['prefill']}+{r['decode']}: {r['slo_attainment']}"
                      + (" at most (stopped)" if r.get("stopped") else "") for r in auto["static"]))
    print(f"{'n':>2} {'x':>6} {'day':>7} {'burst 1':>8} {'burst 2':>8}  configuration beyond the base (log)")
    lines = []
    for n, r in enumerate(sorted(runs, key=lambda r: r["worker_hours"]), 1):
        met = r["day"] >= 0.99 and min(r["bursts"]) >= 0.99
        x = r["worker_hours"] / static_wh
        ax.plot(x, r["day"], "o" if met else "x", color="#1f77b4" if met else "#d62728", ms=6)
        ax.annotate(str(n), (x, r["day"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        lines.append(f"{n}. {x:.3f}{'' if met else ' (a burst < 0.99)'}: {label(r['config'], base)}")
        print(f"{n:>2} {x:6.3f} {r['day']:7.4f} {r['bursts'][0]:8.4f} {r['bursts'][1]:8.4f}  "
              f"{label(r['config'], base)} ({r['log']})")
    x = head["worker_hours"] / static_wh
    ax.plot(x, head["slo_attainment"], "*", ms=13, color="#2ca02c", mfc="none", label="the bench's headline run")
    ax.plot([], [], "o", color="#1f77b4", label="99% over the day and in each burst")
    ax.plot([], [], "x", color="#d62728", label="a burst under 99%")
    ax.axvline(0.6, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("worker-hours / static minimum's (1.0: static " 
                  f"{auto['static_peak']['prefill']}+{auto['static_peak']['decode']}, {auto['static_peak']['slo_attainment']})")
    ax.set_ylabel("SLO attainment over the day")
    ax.set_title(f"coding day, seed {args.seed}, rate {args.rate:g}: the planner's configurations", fontsize=8)
    ax.legend(fontsize=6, loc="lower right")
    key.axis("off")
    key.text(0, 1, "\n".join(lines), fontsize=6.5, va="top", family="monospace")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
