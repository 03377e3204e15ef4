"""PNG plots of a ``pdserve bench sim`` result, for a person to look at (matplotlib, small files)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, directory: Path, name: str) -> str:
    path = directory / name
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    _pyplot().close(fig)
    return str(path)


def write_plots(result: dict, directory: str | Path, prefix: str = "sim") -> list[str]:
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    policies = result.get("policies")
    if policies:
        names = list(policies)
        fig, axes = plt.subplots(1, 3, figsize=(9, 2.8))
        for ax, (label, get) in zip(axes, (("prefix hit rate", lambda s: s["hit_rate"]),
                                            ("p99 TTFT (s)", lambda s: s["ttft_s"]["p99"]),
                                            ("goodput (req/s)", lambda s: s["goodput_rps"]))):
            ax.bar(range(len(names)), [get(policies[n]) for n in names], color="#4c72b0")
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
            ax.set_title(label, fontsize=9)
        fig.suptitle(f"{result['workers']} workers, {result['requests']} requests", fontsize=9)
        written.append(_save(fig, directory, f"{prefix}-policies.png"))
        fig, ax = plt.subplots(figsize=(6, 2.8))
        for n in names:
            series = policies[n]["series"]
            ax.plot([p["t"] for p in series], [p["queued"] + p["prefill_queue"] for p in series], label=n)
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("requests queued")
        ax.legend(fontsize=7)
        written.append(_save(fig, directory, f"{prefix}-queue-depth.png"))
    autoscale = result.get("autoscale")
    if autoscale:
        written.append(_tradeoff(plt, autoscale, directory, prefix))
        headline = autoscale.get("headline_run")
        if headline:
            fig, ax = plt.subplots(figsize=(6, 2.8))
            d = headline["decisions"]
            ax.plot([x["t"] for x in d], [x["prefill"] + x["decode"] for x in d], label="planner: active workers")
            ax.plot([x["t"] for x in d], [x["warm"] + x.get("warming", 0) for x in d], label="warm pool")
            ax.axhline(autoscale["static_peak"]["workers"], color="grey", ls="--", lw=0.8, label="static peak")
            ax2 = ax.twinx()
            s = headline["series"]
            ax2.plot([p["t"] for p in s], [p["inflight"] for p in s], color="#aaaaaa", lw=0.7)
            ax2.set_ylabel("requests in flight", fontsize=8)
            ax.set_xlabel("simulated time (s)")
            ax.legend(fontsize=7, loc="upper left")
            written.append(_save(fig, directory, f"{prefix}-autoscale-timeline.png"))
    return written


def _tradeoff(plt, autoscale: dict, directory: Path, prefix: str) -> str:
    """Worker-hours (as a share of static peak's) against SLO attainment: static sizes, the planner's
    target sweep and ablations, the threshold rule, perfect foresight; the goal's corner dashed."""
    peak = autoscale["static_peak"]["worker_hours"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    static = sorted(autoscale["static"], key=lambda r: r["worker_hours"])
    ax.plot([r["worker_hours"] / peak for r in static], [r["slo_attainment"] for r in static], "s", color="#555555",
            label="static (prefill+decode searched)")
    sweep = [r for r in autoscale["planner"] if r["variant"].startswith("target")]
    ax.plot([r["worker_hours"] / peak for r in sweep], [r["slo_attainment"] for r in sweep], "o-", label="planner")
    for r in sweep:
        ax.annotate(f"{r['target_utilisation']}", (r["worker_hours"] / peak, r["slo_attainment"]), fontsize=6,
                    xytext=(3, -8), textcoords="offset points")
    for r in autoscale["planner"]:
        if not r["variant"].startswith("target"):
            ax.plot([r["worker_hours"] / peak], [r["slo_attainment"]], "x", ms=7, label=f"planner, {r['variant']}")
    thr = autoscale["threshold"]
    if thr:
        ax.plot([r["worker_hours"] / peak for r in thr], [r["slo_attainment"] for r in thr], "^-",
                label="threshold rule (HPA-like)")
    ideal = autoscale.get("ideal_worker_hours_vs_static")
    if ideal is not None:  # perfect foresight: fractional workers the instant they are needed, every SLO met
        ax.plot([ideal], [1.0], "*", ms=9, color="#2ca02c", label="perfect foresight")
    ax.axhline(0.99, color="grey", lw=0.8, ls="--")
    ax.axvline(0.6, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("worker-hours / static peak's")
    ax.set_ylabel("SLO attainment")
    lowest = min(r["slo_attainment"] for r in static + autoscale["planner"] + thr)
    ax.set_ylim(max(0.0, min(lowest, 0.97) - 0.01), 1.003)
    ax.set_title(f"{autoscale.get('trace_shape', '')} day, {autoscale.get('requests', '')} requests", fontsize=8)
    ax.legend(fontsize=6)
    return _save(fig, directory, f"{prefix}-autoscale-tradeoff.png")
