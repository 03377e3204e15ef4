"""One planner configuration on the k = 12 day, without the static search: how its worker-hours and
attainment move, and why (the reasons its decisions gave, and the demand it read, by tenth of the day).

Used to choose the planner's defaults (BENCHMARKS.md, "Autoscaling, thirteenth session"): each run
is one simulated day (at the default rate ~3 min on a quiet core; a rate-32 day on ``h100-measured``
~15 CPU-min on a 2-core AMD EPYC, thirty-first session). The static peak's worker-hours are
given, from a saved ``bench sim --parts autoscale`` result of the same trace.

Usage: PYTHONPATH=. python benchmarks/probes/planner_config_probe.py coding 1 14.013 '{"warm_min": 0}'
           [--rate 32] [--profile h100-measured] [--router '{"prefill_queue_limit_tokens": 32768}']

Each burst's attainment is printed beside the day's (the bench's rule for static peak provisioning).
``--forecast-curve`` gives the planner a demand forecast by time of day (``services/planner/forecast.py``) learned
from those days' demand curves (``autoscale_demand_curve.py``: other seeds' days), times ``--tok-factor`` and
``--kv-factor`` (a recorded timeline's signals over the curve's estimate).
"""

import argparse
import json
import time
from collections import Counter

from services.planner import policy
from services.planner.forecast import DemandForecast
from services.planner.policy import PlannerConfig
from services.sim import experiments
from services.sim.day_scale import DayScale
from services.sim.metrics import SLO
from services.sim.profiles import load_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=list(experiments.TRACE_SHAPES))
    ap.add_argument("seed", type=int)
    ap.add_argument("static_worker_hours", type=float)
    ap.add_argument("config", nargs="?", default="{}",
                    help="PlannerConfig fields as JSON over its defaults (before the twenty-third session this "
                         "probe set target_utilisation 0.9 unless given)")
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--profile", default="h100", help="the calibration profile (default h100, the bench's)")
    ap.add_argument("--forecast-curve", nargs="+", default=[], metavar="CURVE",
                    help="demand curves of other days: the planner forecasts their median by time of day")
    ap.add_argument("--tok-factor", type=float, default=1.62, help="the recorded prefill tokens/s over a curve's")
    ap.add_argument("--kv-factor", type=float, default=0.88, help="the recorded KV blocks over a curve's")
    ap.add_argument("--router", default="{}",
                    help="RouterPolicyConfig fields as JSON (autoscale_static_points.py takes the same)")
    ap.add_argument("--cold-start-s", type=float,
                    help="a worker's cold start in real seconds over the profile's (gpu_cold_start.py measures one); "
                         "the planner's lookahead follows it")
    ap.add_argument("--burst-detail", type=float, default=0.0, metavar="REAL_S",
                    help="print every tick from this many real seconds before each burst to its end (the decisions, "
                         "the demand read, the cluster's queues) and the attainment of the arrivals of each 30 real "
                         "seconds of it: why a burst was missed")
    args = ap.parse_args()
    overrides, router = json.loads(args.config), json.loads(args.router)
    profile, scale = load_profile(args.profile, cold_start_s=args.cold_start_s), DayScale(7200)
    trace, arrivals = experiments.diurnal_day(args.seed, profile, args.rate, scale, args.shape)
    # as the bench builds its planner (the lookahead one cold start unless the config sets it)
    target = overrides.get("target_utilisation", PlannerConfig.target_utilisation)
    base = {k: v for k, v in overrides.items() if k != "target_utilisation"}
    (config,) = experiments.planner_variants(profile, scale, [target], target, False, base).values()
    if args.cold_start_s is not None:
        overrides["cold_start_s"] = args.cold_start_s  # printed only
    forecast = None
    if args.forecast_curve:
        curves = [json.load(open(path)) for path in args.forecast_curve]
        forecast = DemandForecast.from_curves(curves, args.tok_factor, args.kv_factor, scale.period_s)
        overrides["forecast"] = f"{len(curves)} days x ({args.tok_factor}, {args.kv_factor})"  # printed only
    reasons, read = Counter(), []
    decide = policy.Planner.decide

    def traced(self, s):
        d = decide(self, s)
        for reason in d.reason.split("; "):
            reasons[reason.rstrip("0123456789. s").strip()] += 1  # "queue lag 2.1 s" -> "queue lag"
        read.append(s)  # the Signals it decided on
        return d

    policy.Planner.decide = traced
    started = time.time()
    bursts = list(arrivals.bursts)
    bins = [] if not args.burst_detail else [
        (t, min(t + scale.s(30.0), b)) for a, b in bursts
        for t in _steps(a - scale.s(args.burst_detail), b, scale.s(30.0))]
    run = experiments._autoscaled(scale.profile(profile), trace, SLO(2.0, 0.05), scale, "planner", config,
                                  windows=bursts + bins, forecast=forecast,
                                  policy_options=router)
    run["windows"], binned = run["windows"][:len(bursts)], run["windows"][len(bursts):]
    print(f"{args.shape} seed {args.seed} {args.profile} {overrides}{f' router {router}' if router else ''}: attainment {run['slo_attainment']}"
          f"{experiments.bursts_text(run)}, {run['worker_hours']} "
          f"worker-h = {run['worker_hours'] / args.static_worker_hours:.3f} of static, peak {run['peak']}, "
          f"wall {time.time() - started:.0f} s")
    print("  by state", run["worker_hours_by_state"])
    print("  pool events", run["pool_events"])
    print("  share of the finished requests prefilled on their decode worker", run["local_prefill_share"])
    print("  reasons (ticks)", reasons.most_common(6))
    span = scale.period_s / 10
    print(f"{'from s':>7}{'prefill':>9}{'decode':>8}{'warm':>6}{'tokens/s':>10}{'KV blocks':>11}{'sequences':>11}")
    for b in range(10):
        ds = [d for d in run["decisions"] if b * span <= d["t"] < (b + 1) * span]
        rs = [r for r in read if b * span <= r.now < (b + 1) * span]
        if ds and rs:
            print(f"{b * span:>7.0f}{sum(d['prefill'] for d in ds) / len(ds):>9.1f}"
                  f"{sum(d['decode'] for d in ds) / len(ds):>8.1f}"
                  f"{sum(d['warm'] + d['warming'] for d in ds) / len(ds):>6.1f}"
                  f"{sum(r.prefill_tokens_per_s for r in rs) / len(rs):>10.0f}"
                  f"{sum(r.kv_blocks_used for r in rs) / len(rs):>11.0f}{sum(r.running_seqs for r in rs) / len(rs):>11.0f}")
    if args.burst_detail:
        _burst_detail(run, read, bursts, binned, scale.s(args.burst_detail))


def _steps(a: float, b: float, step: float):
    while a < b:
        yield a
        a += step


def _burst_detail(run: dict, read: list, bursts: list, binned: list[dict], before_s: float) -> None:
    """Every tick around each burst (simulated seconds) and the attainment of each bin of its arrivals."""
    for i, (a, b) in enumerate(bursts):
        print(f"burst {i + 1}: {a:.1f}-{b:.1f} s (simulated), attainment of its arrivals by bin:",
              ", ".join(f"{w['start_s']:.1f}: {w['slo_attainment']} of {w['requests']}" for w in binned
                        if a - before_s <= w["start_s"] < b))
        print(f"{'t':>8}{'prefill':>8}{'decode':>7}{'warm':>5}{'warming':>8}{'tokens/s':>10}{'KV':>7}{'seqs':>6}"
              f"{'queued tok':>11}{'pf (starting)':>14}{'dec (starting)':>15}{'TTFT ok':>8}  reason")
        for d in (d for d in run["decisions"] if a - before_s <= d["t"] <= b):
            r = min(read, key=lambda r: abs(r.now - d["t"]))
            ttft = "" if r.ttft_attainment is None else f"{r.ttft_attainment:.3f}"
            print(f"{d['t']:>8.1f}{d['prefill']:>8}{d['decode']:>7}{d['warm']:>5}{d['warming']:>8}"
                  f"{r.prefill_tokens_per_s:>10.0f}{r.kv_blocks_used:>7.0f}{r.running_seqs:>6.0f}"
                  f"{r.queued_prefill_tokens:>11.0f}{f'{r.prefill_workers} ({r.prefill_starting})':>14}"
                  f"{f'{r.decode_workers} ({r.decode_starting})':>15}{ttft:>8}  {d['reason']}")

if __name__ == "__main__":
    main()
