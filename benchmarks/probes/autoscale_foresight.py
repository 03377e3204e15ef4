"""Probe: an autoscaler that knows the day's arrival rate ahead, on the k = 12 day. How far under static
peak provisioning can whole workers, started cold when needed, go at given targets, and does the SLO hold?

The planner (``pdserve planner``) reads its demand from the cluster and must guess where it goes; this
controller reads it from the trace's own arrival rate (``ArrivalShape.rate_at``, bursts included), which no
real autoscaler has. Its demand is the highest rate over ``[now - hold, now + lead]`` (lead: a cold start and
two ticks, so a worker ordered now serves when the rate arrives; hold: the sessions a rise started keep
sending turns after it), converted to prefill tokens/s and decode KV blocks by ``--tokens-per-start`` and
``--kv-per-start`` (the reference planner run's demand over its arrival rate, per tenth of the day: 4,470-5,360
tokens/s and 1,570-2,260 KV blocks per session start a second; ``sim-autoscale-h100-measured-stepped-20261127-
s22.log``). Counts: ``ceil(demand / (one worker's capacity x target))`` per role, at least one each; no warm pool
(the lead stands in for it), no hysteresis beyond the hold. Worker-hours are accounted as the planner's are.
With ``--curve`` (one or more ``autoscale_demand_curve.py`` files) the demand is read instead from those
curves, bin by bin (their median when several: a forecast learned from other days, whose bursts fall at other
times and drop out of the median; the day's own curve: foresight of its demand, noise and bursts included),
times ``--tok-factor`` and ``--kv-factor`` (the recorded signals over the trace's estimate), over the same
window. Printed per tenth of the day (of ``--until``'s span): the counts, and the requests that arrived and missed the SLO
(as the bench judges the bursts: finished late, or waiting past the TTFT SLO; and by a late first token or a
slow ITL, and unfinished at the end).

    PYTHONPATH=. python benchmarks/probes/autoscale_foresight.py coding 1 38.026 --rate 32 \
        --profile h100-measured --prefill-target 0.6 --kv-target 0.7
"""

import argparse
import json
import math
import time

from autoscale_day import add_day_arguments, load_day_and_arrivals

from services.planner.forecast import DemandForecast
from services.planner.policy import Capacity, Decision, PlannerConfig
from services.sim import autoscale, experiments
from services.sim.metrics import SLO, itl, ttft


class Foresight:
    """Decides as ``Planner.decide`` does, from the demand ahead instead of the signals: ``demand_at(t)`` gives
    (prefill tokens/s, KV blocks) at simulated second t."""

    def __init__(self, config: PlannerConfig, capacity: Capacity, demand_at, args, lead_s: float, hold_s: float):
        self.config, self.capacity, self.demand_at = config, capacity, demand_at
        self.args, self.lead_s, self.hold_s = args, lead_s, hold_s

    def decide(self, s) -> Decision:
        a, cap = self.args, self.capacity
        steps = 64
        span = self.hold_s + self.lead_s
        ahead = [self.demand_at(s.now - self.hold_s + span * i / steps) for i in range(steps + 1)]
        prefill = math.ceil(max(d[0] for d in ahead) / (cap.prefill_tokens_per_s * a.prefill_target))
        decode = math.ceil(max(d[1] for d in ahead) / (cap.kv_blocks * a.kv_target))
        return Decision(max(prefill, 1), max(decode, 1), 0, "foresight")


def curve_demand(paths: list[str], tok_factor: float, kv_factor: float):
    """(prefill tokens/s, KV blocks) at t from demand curves: the median of theirs, bin by bin, scaled (the
    planner's ``DemandForecast``, every bin of the curves kept), t held within the curves' span."""
    try:
        f = DemandForecast.from_curves([json.load(open(p)) for p in paths], tok_factor, kv_factor)
    except ValueError as e:
        raise SystemExit(str(e)) from None

    def at(t: float) -> tuple[float, float]:
        tok, kv, _ = f.expected(*[min(max(t, 0.0), f.period_s - f.bin_s / 2)] * 2)
        return tok, kv
    return at


def main() -> None:
    ap = argparse.ArgumentParser()
    add_day_arguments(ap, rate=32.0)
    ap.add_argument("static_worker_hours", type=float, help="static peak provisioning's worker-hours on this day")
    ap.add_argument("--prefill-target", type=float, default=0.6, help="prefill tokens/s over capacity (0.6)")
    ap.add_argument("--kv-target", type=float, default=0.7, help="decode KV blocks in use over capacity (0.7)")
    ap.add_argument("--tokens-per-start", type=float, default=4700.0,
                    help="prefill tokens/s per session start a second (4,700)")
    ap.add_argument("--kv-per-start", type=float, default=2250.0,
                    help="decode KV blocks in use per session start a second (2,250)")
    ap.add_argument("--curve", nargs="+", default=[],
                    help="demand curves (autoscale_demand_curve.py) to read the demand from instead of the rate")
    ap.add_argument("--tok-factor", type=float, default=1.6,
                    help="with --curve: the recorded prefill tokens/s over the curve's (1.6)")
    ap.add_argument("--kv-factor", type=float, default=0.86,
                    help="with --curve: the recorded KV blocks over the curve's (0.86)")
    ap.add_argument("--hold-s", type=float, default=150.0, help="the hold, in a real day's seconds (150)")
    ap.add_argument("--until", type=float, default=None, help="stop the day at this simulated second")
    ap.add_argument("--starts-only", action="store_true",
                    help="print each tenth of the day's mean session starts a second and stop (a run's demand a "
                         "tenth over these is its demand per start: how the defaults above were read)")
    args = ap.parse_args()
    for name in ("prefill_target", "kv_target"):
        if not 0 < getattr(args, name) <= 1:
            ap.error(f"--{name.replace('_', '-')} must be in (0, 1]")
    profile, scale, trace, arrivals = load_day_and_arrivals(args)
    if args.starts_only:
        tenth = scale.period_s / 10
        for b in range(10):
            rates = [arrivals.rate_at(tenth * (b + i / 1000)) for i in range(1000)]
            print(f"{b * tenth:>7.0f} {sum(rates) / len(rates):.2f} session starts/s")
        return
    if args.until is not None:
        trace = [r for r in trace if r.arrival < args.until]
    served = scale.profile(profile)
    lead_s, hold_s = served.cold_start_s + 2 * scale.tick_s, scale.s(args.hold_s)
    if args.curve:
        demand_at = curve_demand(args.curve, args.tok_factor, args.kv_factor)
        source = f"curves {' '.join(args.curve)} x ({args.tok_factor}, {args.kv_factor})"
    else:
        def demand_at(t):
            rate = arrivals.rate_at(t)
            return args.tokens_per_start * rate, args.kv_per_start * rate
        source = "the arrival rate"
    # the simulator's autoscaler builds its planner by this name: the foresight stands in for it
    autoscale.Planner = lambda config, capacity, *_: Foresight(config, capacity, demand_at, args, lead_s, hold_s)
    captured = []
    summarize = experiments.summarize

    def keep(sim, slo, *a, **k):  # the run's cluster, for where in the day its misses fell
        captured.append(sim)
        return summarize(sim, slo, *a, **k)

    experiments.summarize = keep
    slo = SLO(2.0, 0.05)
    started = time.time()
    run = experiments._autoscaled(served, trace, slo, scale, "planner",
                                  PlannerConfig(warm_min=0), windows=list(arrivals.bursts))
    print(f"{args.shape} seed {args.seed} {args.profile} rate {args.rate:g}: foresight of {source}, prefill target "
          f"{args.prefill_target}, KV target {args.kv_target}, hold {args.hold_s:g} s, lead {lead_s:.2f} s: attainment "
          f"{run['slo_attainment']}{experiments.bursts_text(run)}, {run['worker_hours']} worker-h = "
          f"{run['worker_hours'] / args.static_worker_hours:.3f} of static, peak {run['peak']}, "
          f"wall {time.time() - started:.0f} s")
    print("  by state", run["worker_hours_by_state"])
    print("  pool events", run["pool_events"])
    span = (args.until or scale.period_s) / 10
    jobs = captured[-1].jobs
    print(f"{'from s':>7}{'prefill':>9}{'decode':>8}{'arrived':>9}{'missed':>8}{'TTFT':>6}{'ITL':>6}{'unfinished':>11}")
    for b in range(10):
        ds = [d for d in run["decisions"] if b * span <= d["t"] < (b + 1) * span]
        js = [j for j in jobs if b * span <= j.req.arrival < (b + 1) * span]
        done = [j for j in js if j.finished_at > 0]
        late_first = sum(ttft(j) > slo.ttft_s for j in done)
        slow = sum(itl(j) > slo.itl_s for j in done)
        missed = experiments._missed_in(slo, js, captured[-1].loop.now)  # as the bench judges the bursts
        if ds:
            print(f"{b * span:>7.0f}{sum(d['prefill'] for d in ds) / len(ds):>9.1f}"
                  f"{sum(d['decode'] for d in ds) / len(ds):>8.1f}{len(js):>9}{missed:>8}{late_first:>6}{slow:>6}"
                  f"{len(js) - len(done):>11}")


if __name__ == "__main__":
    main()
