"""``pdserve bench sim``: the router's real code at 1,000 workers, against modelled workers.

Runs, in one command (each part can be skipped):

1. **policies**: ``--workers`` (default 1,000; ``--prefill-share`` of them prefill) and
   ``--requests`` (default 100,000) of the four-pattern mix (workloads.py) through
   round-robin, least-load, kv-aware and kv-aware-lb, the same requests each;
   prefix hit rate, TTFT / ITL percentiles, goodput under ``--ttft-slo`` / ``--itl-slo``,
   utilisation, queue depth over time; wall time of each run.
2. **layouts**: prefill:decode splits and conditional disaggregation on and off
   (``--layout-workers`` workers, a tenth of the requests).
3. **validation**: ``pdserve bench routing``'s setup at 2 workers on the CPU profile, on
   every seed of the repeated real runs (the calibration file's ``validation_reference``),
   the ratios' means on both sides with their intervals (validation.py).
4. **autoscale**: one day of a diurnal trace compressed to ``--period-s`` (every time the
   autoscalers measure against the day compressed with it: day_scale.py), shaped on the
   Azure LLM inference trace 2024 (``--trace-shape coding``: peak-to-trough ~10x;
   ``conversation``: ~2.4x) with bursts (``--burst-factor``): the planner at several
   target utilisations (and without its trend lookahead, and without a warm pool), the
   HPA-like threshold rule, and static provisioning searched down to the smallest meeting
   99% (prefill and decode sized apart; ``--static-from`` takes a saved search of the same
   trace and re-runs only its answer); SLO attainment against worker-hours, beside perfect
   foresight's (the day's mean rate over its peak). Then the
   headline planner and the static search again on ``--check-trace`` (another shape and
   seed): a planner tuned to one trace would show it there.

``--json`` prints one object (headline keys first); ``--plots DIR`` writes PNGs;
``--save`` keeps the full result under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from services.bench import results as result_files
from services.bench.stats import ratio
from services.sim import experiments, validation
from services.sim.day_scale import DayScale
from services.sim.metrics import SLO
from services.sim.plots import write_plots
from services.sim.profiles import CALIBRATION, load_profile

PARTS = ("policies", "layouts", "validation", "autoscale")


def run(args: argparse.Namespace) -> int:
    parts = set(args.parts.split(","))
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    unknown = set(args.policies) - set(experiments.POLICY_VARIANTS)
    if unknown or not {"kv-aware", "round-robin"} <= set(args.policies):
        raise ValueError(f"--policies must include kv-aware and round-robin (the headline ratios) and name only "
                         f"{', '.join(experiments.POLICY_VARIANTS)}")
    if "autoscale" in parts and args.headline_target not in args.planner_targets:
        raise ValueError(f"--headline-target {args.headline_target} must be one of --planner-targets")
    if args.workers < 2 or args.requests < 1:
        raise ValueError("--workers must be >= 2 and --requests >= 1")
    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    if args.cold_start_s is not None and not args.cold_start_s > 0:
        raise ValueError("--cold-start-s must be positive (seconds of a real day)")
    profile = load_profile(args.profile, args.calibration, args.cold_start_s)
    planner_base = _planner_config(args.planner_config) if "autoscale" in parts else None
    slo = SLO(args.ttft_slo, args.itl_slo)
    result: dict = {"workers": args.workers, "requests": args.requests, "profile": profile.name,
                    "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}, "seed": args.seed}
    started = time.perf_counter()
    if "policies" in parts or "layouts" in parts:
        requests = experiments.scale_workload(args.seed, profile, args.workers, args.requests, args.rate_per_worker)
        result["requests"] = len(requests)
    if "policies" in parts:
        prefill = max(1, round(args.workers * args.prefill_share))
        policies = experiments.run_policies(profile, requests, prefill, args.workers - prefill, slo,
                                            policies=args.policies)
        result["policies"] = policies
        result["wall_s"] = policies["kv-aware"]["wall_s"]
        result["cpu_s"] = policies["kv-aware"]["cpu_s"]
        result["hit_rate_ratio_kv_vs_rr"] = ratio(policies["kv-aware"]["hit_rate"], policies["round-robin"]["hit_rate"])
        result["goodput_ratio_kv_vs_rr"] = ratio(policies["kv-aware"]["goodput_rps"],
                                                 policies["round-robin"]["goodput_rps"])
    if "layouts" in parts:
        result["layouts"] = experiments.run_layouts(profile, requests[: max(1, len(requests) // 10)],
                                                    args.layout_workers, slo)
    if "validation" in parts:
        path = Path(args.calibration) if args.calibration else CALIBRATION
        reference = json.loads(path.read_text())["validation_reference"]
        result["validation"] = validation.run_validation(load_profile("cpu", args.calibration), reference)
    if "autoscale" in parts:
        scale = DayScale(args.period_s)
        trace, arrivals = experiments.diurnal_day(args.seed, profile, args.autoscale_rate, scale, args.trace_shape,
                                                  args.burst_factor)
        _log(f"autoscale: {len(trace)} requests, {args.trace_shape} day compressed {scale.k:.0f}x to "
             f"{args.period_s:.0f} s (cold start {scale.s(profile.cold_start_s):.2f} s, tick {scale.tick_s:.2f} s), "
             f"seed {args.seed}")
        forecast = _forecast(args, scale)
        auto = experiments.run_autoscale(profile, trace, slo, scale, planner_targets=args.planner_targets,
                                         threshold_targets=args.threshold_targets,
                                         headline_target=args.headline_target, ablations=not args.no_ablations,
                                         static_start=args.static_start,
                                         static_known=(known := _static_from(args, len(trace))),
                                         static_windows=_static_windows(args, arrivals),
                                         planner_base=planner_base, forecast=forecast, jobs=args.jobs)
        if known and not args.threshold_targets:  # the threshold rule's runs too: a baseline of the same trace
            auto["threshold"] = known.get("threshold", [])
        auto.update(static_from=Path(args.static_from).name if args.static_from else None,
                    requests=len(trace), trace_shape=args.trace_shape, seed=args.seed,
                    burst_factor=args.burst_factor, period_s=args.period_s, rate=args.autoscale_rate,
                    static_goal=args.static_goal, ideal_worker_hours_vs_static=experiments.ideal_ratio(arrivals),
                    ideal_worker_hours_vs_diurnal_peak=experiments.ideal_ratio(arrivals, bursts=False),
                    planner_config=planner_base,
                    forecast={"curves": [Path(c).name for c in args.forecast_curve], "tok_factor": args.tok_factor,
                              "kv_factor": args.kv_factor} if forecast else None)
        result["autoscale"] = auto
        result["autoscale_slo_attainment"] = auto["headline_run"]["slo_attainment"]
        # the least of the bursts' own attainments: the day's can meet 99% with a burst dropped
        result["autoscale_burst_slo_attainment"] = experiments.least_window_attainment(auto["headline_run"])
        result["autoscale_worker_hours_vs_static"] = ratio(auto["headline_run"]["worker_hours"],
                                                           auto["static_peak"]["worker_hours"])
        result["autoscale_ideal_worker_hours_vs_static"] = auto["ideal_worker_hours_vs_static"]
        result["autoscale_ideal_worker_hours_vs_diurnal_peak"] = auto["ideal_worker_hours_vs_diurnal_peak"]
        result["autoscale_static_goal"] = args.static_goal
        if args.check_trace:
            shape, _, seed = args.check_trace.partition(":")
            seed = int(seed or args.seed + 1)
            trace, arrivals = experiments.diurnal_day(seed, profile, args.autoscale_rate, scale, shape,
                                                      args.burst_factor)
            _log(f"autoscale check: {len(trace)} requests, {shape} day, seed {seed}")
            check = experiments.run_autoscale(profile, trace, slo, scale, planner_targets=[args.headline_target],
                                              threshold_targets=[], headline_target=args.headline_target,
                                              ablations=False,
                                              static_windows=_static_windows(args, arrivals),
                                              planner_base=planner_base, jobs=args.jobs)
            check.update(requests=len(trace), trace_shape=shape, seed=seed,
                         static_goal=args.static_goal, ideal_worker_hours_vs_static=experiments.ideal_ratio(arrivals),
                         ideal_worker_hours_vs_diurnal_peak=experiments.ideal_ratio(arrivals, bursts=False),
                         burst_slo_attainment=experiments.least_window_attainment(check["headline_run"]),
                         worker_hours_vs_static=ratio(check["headline_run"]["worker_hours"],
                                                      check["static_peak"]["worker_hours"]))
            result["autoscale_check"] = check
    result["total_wall_s"] = round(time.perf_counter() - started, 1)
    if args.plots:
        result["plots"] = write_plots(result, args.plots)
    result_files.save("sim", result, args)
    if args.json:
        print(json.dumps(_headline_first(result)))
    else:
        print_table(result)
    return 0


HEADLINE = ("workers", "requests", "wall_s", "cpu_s", "hit_rate_ratio_kv_vs_rr", "goodput_ratio_kv_vs_rr",
            "autoscale_slo_attainment", "autoscale_burst_slo_attainment", "autoscale_worker_hours_vs_static", "autoscale_ideal_worker_hours_vs_static",
            "autoscale_ideal_worker_hours_vs_diurnal_peak", "autoscale_static_goal",
            "validation")


def _log(msg: str) -> None:
    print(f"[bench sim] {msg}", file=sys.stderr, flush=True)


def _headline_first(result: dict) -> dict:
    def strip(value):  # time series stay in the saved file, not on stdout
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("series", "decisions")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    out = {k: result[k] for k in HEADLINE if k in result}
    out.update({k: strip(v) for k, v in result.items() if k not in out})
    return out


def print_table(result: dict) -> None:
    policies = result.get("policies")
    if policies:
        print(f"{result['workers']} workers ({result['profile']}), {result['requests']} requests; "
              f"SLO TTFT {result['slo']['ttft_s']} s, ITL {result['slo']['itl_s']} s")
        print(f"{'policy':<13}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}{'goodput':>9}"
              f"{'SLO met':>9}{'wall s':>8}")
        for name, s in policies.items():
            print(f"{name:<13}{s['hit_rate']:>9.3f}{s['ttft_s']['p50']:>10.3f}{s['ttft_s']['p99']:>10.3f}"
                  f"{s['itl_s']['p99']:>9.4f}{s['goodput_rps']:>9.1f}{s['slo_attainment']:>9.3f}{s['wall_s']:>8.1f}")
        print(f"hit_rate_ratio_kv_vs_rr {result['hit_rate_ratio_kv_vs_rr']}  "
              f"goodput_ratio_kv_vs_rr {result['goodput_ratio_kv_vs_rr']}")
    for row in result.get("layouts", []):
        print(f"layout {row['prefill']}:{row['decode']} disaggregation {row['disaggregation']:<6} goodput "
              f"{row['goodput_rps']:.1f} req/s, p99 TTFT {row['ttft_s']['p99']:.3f} s, local prefills "
              f"{row['local_prefill_share']:.2f}")
    v = result.get("validation")
    if v:
        print(f"validation against {v['source']}, seeds {v['seeds']} ({v['workload']}); kv-aware / round-robin, "
              "means over the seeds [90% bootstrap interval]:")
        for name, r in v["ratios_kv_over_rr"].items():
            def show(side):
                ci = side["interval_90"]
                return f"{side['mean']}" + (f" [{ci[0]} .. {ci[1]}]" if ci else "")
            print(f"  {name:<10} simulated {show(r['sim'])}  real {show(r['real'])}  error {r['error']:+.1%} "
                  f"(per seed {show(r['per_seed_error'])})")
        for policy, figures in v["per_policy"].items():
            print(f"  {policy}: " + ", ".join(f"{k} {f['sim']} / {f['real']} ({f['error']:+.1%})"
                                             for k, f in figures.items()))
    a = result.get("autoscale")
    if a:
        peak = a["static_peak"]
        print(f"autoscale ({a['requests']} requests, {a['trace_shape']} day compressed {a['day_scale']['k']:.0f}x, "
              f"seed {a['seed']}): static peak {peak['prefill']}+{peak['decode']} workers = {peak['worker_hours']} "
              f"worker-h, meeting 99% in {'the day and each burst' if a.get('static_goal') == 'bursts' else 'the day'}; "
              f"perfect foresight {a['ideal_worker_hours_vs_static']} of it (against the diurnal peak without the "
              f"bursts: {a['ideal_worker_hours_vs_diurnal_peak']})")
        for r in a["planner"]:
            print(f"  planner {r['variant']}: SLO {r['slo_attainment']:.4f}{experiments.bursts_text(r)}, "
                  f"{r['worker_hours']} worker-h "
                  f"({r['worker_hours'] / peak['worker_hours']:.2f} of static peak), peak {r['peak']}")
        for r in a["threshold"]:
            print(f"  threshold {r['target']}: SLO {r['slo_attainment']:.4f}{experiments.bursts_text(r)}, "
                  f"{r['worker_hours']} worker-h "
                  f"({r['worker_hours'] / peak['worker_hours']:.2f})")
        print(f"autoscale_slo_attainment {result['autoscale_slo_attainment']}  "
              f"autoscale_burst_slo_attainment {result['autoscale_burst_slo_attainment']}  "
              f"autoscale_worker_hours_vs_static {result['autoscale_worker_hours_vs_static']}")
    c = result.get("autoscale_check")
    if c:
        print(f"check ({c['requests']} requests, {c['trace_shape']} day, seed {c['seed']}): planner SLO "
              f"{c['headline_run']['slo_attainment']:.4f} at {c['worker_hours_vs_static']} of static peak "
              f"({c['static_peak']['prefill']}+{c['static_peak']['decode']}); perfect foresight "
              f"{c['ideal_worker_hours_vs_static']}")


def _static_from(args, requests: int) -> dict | None:
    """The ``autoscale`` object of ``--static-from``'s saved result, refused unless its trace is this run's."""
    if not args.static_from:
        return None
    saved = json.loads(Path(args.static_from).read_text())["result"]
    auto = saved.get("autoscale") or {}
    want = {"profile": args.profile, "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo}, "seed": args.seed,
            "trace_shape": args.trace_shape, "rate": args.autoscale_rate, "period_s": args.period_s,
            "burst_factor": args.burst_factor, "requests": requests, "static_goal": args.static_goal}
    # top-level "requests": the policy part's; a search saved before static_goal existed judged the day alone
    have = {k: auto[k] if k in auto else saved.get(k, "day" if k == "static_goal" else None) for k in want}

    if have != want or not auto.get("static_peak"):
        raise ValueError(f"--static-from {args.static_from}: not this run's trace, or no static search in it "
                         f"(saved {have}; this run {want})")
    return auto


def _planner_config(text: str) -> dict:
    """``--planner-config``: PlannerConfig fields over its defaults, checked here (a typo is an error, not a
    default run)."""
    from services.planner.policy import PlannerConfig

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--planner-config is not JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise ValueError("--planner-config must be a JSON object of PlannerConfig fields")
    known = {f.name for f in dataclasses.fields(PlannerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--planner-config: unknown field(s) {unknown}; PlannerConfig has {', '.join(sorted(known))}")
    if "target_utilisation" in fields:
        raise ValueError("--planner-config: set the target with --planner-targets and --headline-target")
    try:
        PlannerConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--planner-config: {exc}") from exc
    return fields


def _forecast(args, scale: DayScale):
    """``--forecast-curve``: the planner's demand forecast from other days' curves of this run's trace
    (``benchmarks/probes/autoscale_demand_curve.py``), refused when a curve is of another trace or of this day."""
    if not args.forecast_curve:
        return None
    from services.planner.forecast import DemandForecast

    curves = []
    for path in args.forecast_curve:
        try:
            curve = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--forecast-curve {path}: cannot read a demand curve: {exc}") from exc
        # its shape and costs must be this day's; its rate may differ: the planner scales the forecast to the
        # demand it sees, so only the curve's shape by time of day reaches its decisions (forecast.py)
        want = {"shape": args.trace_shape, "profile": args.profile}
        have = {k: curve.get(k) for k in want}
        if have != want:
            raise ValueError(f"--forecast-curve {path}: a curve of {have}, this run's day is {want}")
        if curve.get("seed") == args.seed:
            raise ValueError(f"--forecast-curve {path}: the curve of this very day (seed {args.seed}) is foresight, "
                             "not a forecast; give other seeds' curves")
        span = len(curve.get("tok_s", [])) * float(curve.get("bin_s", 0))
        if abs(span - scale.period_s) > 2 * float(curve.get("bin_s", 0)):
            raise ValueError(f"--forecast-curve {path}: covers {span:.0f} s, this run's day is {scale.period_s:.0f} s "
                             "(--period-s)")
        curves.append(curve)
    return DemandForecast.from_curves(curves, args.tok_factor, args.kv_factor, scale.period_s)


def _static_windows(args, arrivals) -> list:
    """The spans static provisioning is judged in besides the day: the bursts, with ``--static-goal bursts``."""
    return list(arrivals.bursts) if args.static_goal == "bursts" else []


def _workers_pair(text: str) -> tuple[int, int]:
    p, plus, d = text.partition("+")
    if not plus or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
        raise argparse.ArgumentTypeError(f"expected P+D with P, D >= 1 (e.g. 9+4), got {text!r}")
    return int(p), int(d)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def add_parser(sub) -> None:
    p = sub.add_parser("sim", help="the real router and queue code against modelled workers, at up to 1,000s",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts to run ({', '.join(PARTS)})")
    p.add_argument("--workers", type=int, default=1000, help="workers in the policy comparison")
    p.add_argument("--policies", type=lambda text: [x for x in text.split(",") if x],
                   default=list(experiments.POLICY_VARIANTS),
                   help=f"policies compared ({', '.join(experiments.POLICY_VARIANTS)})")
    p.add_argument("--prefill-share", type=float, default=0.25, help="share of the workers that prefill")
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--rate-per-worker", type=float, default=0.3, help="session starts per second per worker")
    p.add_argument("--layout-workers", type=int, default=100)
    p.add_argument("--profile", default="h100",
                   help="worker profile from the calibration file (h100: derived from the datasheet; "
                   "h100-measured, h200: measured on a lent H100 / H200; cpu)")
    p.add_argument("--calibration", default=None, help=f"calibration file (default {CALIBRATION.name} in services/sim)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.05, help="seconds")
    p.add_argument("--period-s", type=float, default=1800.0,
                   help="the autoscale trace's day compressed to this (one is run); cold start, tick, hysteresis, "
                        "lookahead and bursts are compressed by the same 86,400 / period_s")
    p.add_argument("--autoscale-rate", type=float, default=32.0,
                   help="mean session starts per second over the day (32: ~25 workers at peak on h100)")
    p.add_argument("--trace-shape", default="coding", choices=list(experiments.TRACE_SHAPES),
                   help="the day's shape: Azure 2024 coding (peak-to-trough ~10x) or conversation (~2.4x)")
    p.add_argument("--burst-factor", type=float, default=1.5, help="load multiplier of the two 120 s bursts")
    p.add_argument("--check-trace", default="conversation:1", metavar="SHAPE[:SEED]",
                   help="run the headline planner and the static search again on this trace ('' : skip)")
    p.add_argument("--planner-targets", type=_floats, default=[0.6, 0.7, 0.8])
    p.add_argument("--threshold-targets", type=_floats, default=[0.5, 0.7])
    p.add_argument("--headline-target", type=float, default=0.6,
                   help="the planner run the headline figures use (default 0.6: the planner's own default target)")
    p.add_argument("--no-ablations", action="store_true",
                   help="skip the planner without lookahead and without warm pool (a shorter run)")
    p.add_argument("--static-goal", choices=("bursts", "day"), default="bursts",
                   help="what static peak provisioning must meet 99%% in: bursts (the day and each of its bursts: "
                        "peak provisioning serves the day's highest load at the SLO) or day (the day's share alone: "
                        "a fleet that may drop part of a burst)")
    p.add_argument("--static-start", type=_workers_pair, default=None, metavar="P+D",
                   help="start the static-peak search at P prefill + D decode workers (default: the headline "
                        "planner's 95th-percentile counts); the search still goes down to the smallest meeting 99%%")
    p.add_argument("--static-from", default=None, metavar="RESULT.json",
                   help="take the static-peak search (and, with --threshold-targets '', the threshold rule's runs) "
                        "from a saved bench sim result on the same trace (seed, shape, rate, day, profile, SLOs "
                        "checked); the static peak is re-run once to confirm the simulator still gives it")
    p.add_argument("--planner-config", default="{}", metavar="JSON",
                   help="PlannerConfig fields over its defaults in every planner run (e.g. "
                        "'{\"warm_confirm_s\": 30, \"burst_factor\": 1.0}'); the target comes from --planner-targets, the "
                        "lookahead is one cold start unless lookahead_s is set here")
    p.add_argument("--forecast-curve", nargs="+", default=[], metavar="CURVE",
                   help="demand curves of other days of this trace (benchmarks/probes/autoscale_demand_curve.py): "
                        "every planner run forecasts their median by time of day (services/planner/forecast.py)")
    p.add_argument("--tok-factor", type=float, default=1.62,
                   help="the planner's prefill tokens/s over a curve's (default 1.62, read off a recorded day)")
    p.add_argument("--kv-factor", type=float, default=0.88,
                   help="the planner's KV blocks over a curve's (default 0.88, read off a recorded day)")
    p.add_argument("--cold-start-s", type=float, default=None,
                   help="a worker's cold start in seconds of a real day over the profile's "
                        "(benchmarks/probes/gpu_cold_start.py measures one); the planner's lookahead follows it")
    p.add_argument("--jobs", type=int, default=1,
                   help="autoscale runs side by side, each in its own process (a rate-64 day's run takes ~10 GB; "
                        "with --static-start the static search's three points start beside the headline planner); "
                        "the results do not depend on it")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
