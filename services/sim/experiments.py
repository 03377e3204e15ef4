"""The simulator's experiments: policy comparison at scale, autoscaling (the 2-worker validation: validation.py).

Each returns plain data (JSON-ready); ``bench.py`` prints and saves it, ``plots.py`` draws it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import multiprocessing
import sys
import time

from services.planner.policy import PlannerConfig
from services.sim.autoscale import SimAutoscaler
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.day_scale import DayScale
from services.sim.events import collector_paused
from services.sim.metrics import SLO, summarize
from services.sim.profiles import WorkerProfile
from services.sim.workloads import ArrivalShape, WorkloadGenerator

# The comparison's policies: name -> (router policy, its options). "kv-aware-lb" is kv-aware that
# weighs queued work as much as computed work and samples near-ties (several routers' setting).
POLICY_VARIANTS = {
    "round-robin": ("round-robin", {}),
    "least-load": ("least-load", {}),
    "kv-aware": ("kv-aware", {}),
    "kv-aware-lb": ("kv-aware", {"load_weight": 1.0, "temperature": 1.0, "seed": 0}),
}


def _log(msg: str) -> None:
    print(f"[bench sim] {msg}", file=sys.stderr, flush=True)


def scale_workload(seed: int, profile: WorkerProfile, workers: int, requests: int, per_worker_rate: float):
    """``requests`` requests from the four-pattern mix at a load proportional to ``workers``."""
    rate = per_worker_rate * workers
    # ~2.4 requests per session with the default mix; a little longer than needed, then cut (a small
    # run's session count varies more: lengthen until there are enough)
    duration = requests / (rate * 2.4) * 1.15
    while True:
        reqs = WorkloadGenerator(seed, profile.block_size).sessions(ArrivalShape(rate=rate, duration_s=duration))
        if len(reqs) >= requests:
            return reqs[:requests]
        duration *= 1.25 * requests / max(len(reqs), 1)


def run_policies(profile: WorkerProfile, requests, prefill: int, decode: int, slo: SLO,
                 policies=tuple(POLICY_VARIANTS), disaggregation: str = "always", **config) -> dict:
    out = {}
    for name in policies:
        policy, options = POLICY_VARIANTS[name]
        reqs = copy.deepcopy(requests)
        started, cpu = time.perf_counter(), time.process_time()
        sim = ClusterSim(ClusterConfig(profile, prefill, decode, policy=policy, policy_options=options,
                                       disaggregation=disaggregation, **config), reqs).run()
        wall = time.perf_counter() - started
        summary = summarize(sim, slo)
        summary["wall_s"] = round(wall, 2)
        # CPU seconds this process got: on a machine shared with other jobs, wall time overstates the cost
        summary["cpu_s"] = round(time.process_time() - cpu, 2)
        summary["series"] = sim.series
        out[name] = summary
        _log(f"{name}: {len(reqs)} requests on {prefill}+{decode} workers in {wall:.1f} s wall "
             f"({summary['cpu_s']:.1f} s CPU): "
             f"hit rate {summary['hit_rate']}, p99 TTFT {summary['ttft_s']['p99']} s, "
             f"goodput {summary['goodput_rps']} req/s")
    return out


def run_layouts(profile: WorkerProfile, requests, workers: int, slo: SLO) -> list[dict]:
    """Prefill:decode splits, and conditional disaggregation on and off, with kv-aware routing."""
    rows = []
    for prefill_share in (0.125, 0.25, 0.375, 0.5):
        prefill = max(1, round(workers * prefill_share))
        for disagg, options in (("always", {}), ("auto", {"local_prefill_max_tokens": 512,
                                                           "prefill_queue_limit_tokens": 32_768})):
            reqs = copy.deepcopy(requests)
            sim = ClusterSim(ClusterConfig(profile, prefill, workers - prefill, policy="kv-aware",
                                           policy_options=options, disaggregation=disagg), reqs).run()
            s = summarize(sim, slo)
            rows.append({"prefill": prefill, "decode": workers - prefill, "disaggregation": disagg,
                         **{k: s[k] for k in ("hit_rate", "ttft_s", "itl_s", "goodput_rps", "slo_attainment",
                                              "local_prefill_share", "utilisation")}})
            _log(f"layout {prefill}:{workers - prefill} disaggregation {disagg}: goodput {s['goodput_rps']}, "
                 f"p99 TTFT {s['ttft_s']['p99']} s, local prefills {s['local_prefill_share']}")
    return rows


# The diurnal shapes of the Azure LLM inference trace 2024 (a week of May 2024; DynamoLLM, Stojkovic et al.,
# HPCA 2025, arXiv:2408.00741), read off the dataset's own analysis notebook's plot of invocations per
# minute: Coding's weekday peaks 5,000-5,800 and troughs 400-600 a minute (peak-to-trough ~10x);
# Conversation's weekday peaks 4,000-4,900 and troughs 1,700-2,000 (~2.4x). amplitude a gives
# (1 + a) / (1 - a) = that ratio. Bursts: the week's largest one-minute spikes stand ~1.4x above
# their surroundings; the trace's bursts are 1.5x for 120 s, twice a day, at seeded times.
TRACE_SHAPES = {"coding": 0.82, "conversation": 0.41}


def diurnal_day(seed: int, profile: WorkerProfile, rate: float, scale: DayScale, shape: str = "coding",
                burst_factor: float = 1.5) -> tuple[list, ArrivalShape]:
    """One day of the ``shape`` trace compressed to ``scale.period_s`` (its bursts too), and its arrival shape."""
    if shape not in TRACE_SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; choose from {', '.join(TRACE_SHAPES)}")
    arrivals = ArrivalShape(rate=rate, duration_s=scale.period_s, period_s=scale.period_s,
                            diurnal_amplitude=TRACE_SHAPES[shape], bursts_per_period=2,
                            burst_factor=burst_factor, burst_s=scale.burst_s)
    return WorkloadGenerator(seed, profile.block_size).sessions(arrivals), arrivals


def ideal_ratio(arrivals: ArrivalShape, steps: int = 100_000, bursts: bool = True) -> float:
    """Perfect foresight's worker-hours over static peak's: the day's mean arrival rate over its highest
    (bursts included; ``bursts`` False: the diurnal peak's, a fleet sized for the day without its bursts),
    workers fractional and started the instant they are needed. No autoscaler can do better; rounding to
    whole workers and Poisson noise put every real one above it."""
    rate_at = arrivals.rate_at if bursts else dataclasses.replace(arrivals, burst_factor=1.0).rate_at
    rates = [rate_at(arrivals.duration_s * (i + 0.5) / steps) for i in range(steps)]
    return round(sum(rates) / len(rates) / max(rates), 3)


def _fresh(requests):
    """A copy a run may change (arrival times in closed loop); the block-hash lists, which no run
    changes, are shared: a deep copy of a day's 3.6M hashes took ~8 s a run."""
    with collector_paused():
        return [dataclasses.replace(r) for r in requests]


def _autoscaled(profile, requests, slo, scale: DayScale, kind, planner_config=None, threshold=0.7, windows=(),
                forecast=None, policy_options: dict | None = None):
    """``profile``: with its start-up times already compressed by ``scale``. ``windows``: the day's bursts,
    judged apart as the static search judges them (``windows`` in the result). ``forecast``: the planner's
    demand by time of day (``DemandForecast``), in the simulated day's seconds. ``policy_options``: the
    router's (``RouterPolicyConfig`` fields), as ``_static`` takes them."""
    sim = ClusterSim(ClusterConfig(profile, 1, 1, heartbeat_s=scale.heartbeat_s, policy_options=policy_options or {}),
                     _fresh(requests))
    scaler = SimAutoscaler(kind, profile, slo, interval_s=scale.tick_s, planner_config=planner_config,
                           threshold=threshold, threshold_window_s=scale.hpa_window_s, forecast=forecast)
    scaler.attach(sim)
    sim.run()
    s = summarize(sim, slo)
    peak = max(((d["prefill"], d["decode"]) for d in scaler.decisions), key=sum)
    run = {"slo_attainment": s["slo_attainment"], "worker_hours": round(scaler.worker_seconds / 3600, 3),
           "peak": {"prefill": peak[0], "decode": peak[1]}, "ttft_s": s["ttft_s"], "itl_s": s["itl_s"],
           "worker_hours_by_state": {k: round(v / 3600, 3) for k, v in sorted(scaler.breakdown.items())},
           "pool_events": dict(sorted(scaler.pool_events.items())),
           "local_prefill_share": s["local_prefill_share"],
           "decisions": scaler.decisions, "series": sim.series}
    if windows:
        run["windows"] = _window_attainment(sim, slo, windows)
    return run


def _missed_in(slo: SLO, jobs, now: float, a: float = -math.inf, b: float = math.inf) -> int:
    """Requests that arrived in [a, b) and missed the SLO: finished late, or waiting past the TTFT SLO."""
    return sum(1 for j in jobs if a <= j.req.arrival < b and (
        (j.finished_at > 0 and not slo.met(j)) or (j.first_token_at <= 0 and now - j.req.arrival > slo.ttft_s)))


def _window_attainment(sim: ClusterSim, slo: SLO, windows) -> list[dict]:
    """Each window's share of its arrivals that met the SLO, once the run is over."""
    done = [j for j in sim.jobs if j.finished_at > 0]
    out = []
    for a, b in windows:
        n = sum(1 for j in sim.jobs if a <= j.req.arrival < b)
        out.append({"start_s": round(a, 1), "end_s": round(b, 1), "requests": n,
                    "slo_attainment": round(1 - _missed_in(slo, done, sim.loop.now, a, b) / n, 4) if n else 1.0})
    return out


def _static(profile, requests, slo, prefill: int, decode: int, heartbeat_s: float = 1.0, goal: float | None = None,
            policy_options: dict | None = None, windows=()):
    """A static run. ``goal``: stop it once more requests have missed the SLO (finished late, or waiting past
    the TTFT SLO for a first token) than the goal allows; its attainment is then the bound that proves the
    miss ("stopped": true). An under-provisioned day queues without end, every waiting request retrying on
    the Dispatcher's backoff: the static search's failing runs took most of its time.

    ``windows``: (start, end) spans of the day (its bursts) whose arrivals are judged alone too, each against
    ``goal`` (``meets``): peak provisioning serves the day's highest load at the SLO, where the day's share of
    misses lets a fleet sized for the diurnal peak drop a burst. With a goal the run stops in the first window
    whose misses exceed what the goal allows of its arrivals ("stopped_by": "burst i")."""
    sim = ClusterSim(ClusterConfig(profile, prefill, decode, heartbeat_s=heartbeat_s,
                                   policy_options=policy_options or {}), _fresh(requests))
    spans = [(a, b, sum(1 for r in requests if a <= r.arrival < b)) for a, b in windows]

    stopped, in_window = None, {}
    if goal is None:
        sim.run()
    else:
        allowed, step = (1 - goal) * len(requests), max(r.arrival for r in requests) / 100 if requests else 1.0
        sim.run(until=step)
        while len(sim.loop):
            now = sim.loop.now
            missed = _missed_in(slo, sim.jobs, now)
            if missed > allowed:
                stopped, attainment = "day", round(1 - missed / len(requests), 4)
                break
            for i, (a, b, n) in enumerate(spans):
                if now >= b:  # a window once its arrivals are all in: those jobs, found once
                    if i not in in_window:
                        in_window[i] = [j for j in sim.jobs if a <= j.req.arrival < b]
                    late = _missed_in(slo, in_window[i], now)
                    if late > (1 - goal) * n:
                        stopped, attainment = f"burst {i + 1}", round(1 - late / n, 4)
                        break
            if stopped:
                break
            sim.loop.run(now + step)
    if stopped:
        run = {"workers": prefill + decode, "prefill": prefill, "decode": decode, "slo_attainment": attainment,
               "worker_hours": round((prefill + decode) * max(r.arrival for r in requests) / 3600, 3),
               "stopped": True, "stopped_by": stopped, "stopped_at_s": round(sim.loop.now, 1)}
        where = "the day" if stopped == "day" else stopped
        _log(f"static {prefill}+{decode}: attainment in {where} at most {attainment} (stopped at "
             f"{sim.loop.now:.0f} s), {run['worker_hours']} worker-h")
        return run
    s = summarize(sim, slo)
    run = {"workers": prefill + decode, "prefill": prefill, "decode": decode, "slo_attainment": s["slo_attainment"],
           "worker_hours": round((prefill + decode) * sim.loop.now / 3600, 3), "ttft_s": s["ttft_s"],
           "itl_s": s["itl_s"]}
    if spans:
        run["windows"] = _window_attainment(sim, slo, windows)
    _log(f"static {prefill}+{decode}: attainment {run['slo_attainment']}{bursts_text(run)}, {run['worker_hours']} worker-h")
    return run


def least_window_attainment(run: dict) -> float | None:
    """The lowest attainment among a run's judged windows (its bursts); None without windows."""
    return min((w["slo_attainment"] for w in run.get("windows", [])), default=None)


def bursts_text(run: dict) -> str:
    return "".join(f", burst {i + 1} {w['slo_attainment']}" for i, w in enumerate(run.get("windows", [])))


def meets(run: dict, goal: float) -> bool:
    """A static run meets ``goal`` over the day and in each of its judged windows."""
    return run["slo_attainment"] >= goal and all(w["slo_attainment"] >= goal for w in run.get("windows", []))


def static_peak(profile, requests, slo, hint: tuple[int, int], goal: float = 0.99,
                heartbeat_s: float = 1.0, windows=(), runs_of: "DayRuns | None" = None,
                ahead: dict | None = None) -> tuple[dict, list[dict]]:
    """The smallest static provisioning meeting ``goal``, prefill and decode sized apart (a fixed split
    would charge static for the role it over-provisions): from ``hint`` (grown by a quarter until it
    meets the goal), gallop each role down (1, 2, 4, ... fewer) to the first count that fails, then
    bisect, the prefill count first with the decode count held, then the decode count. A hint near
    the answer costs three runs; bisecting down from a planner's peak (5x static's at k = 48) never
    finished in a session. Every run is returned (points of the trade-off curve). ``runs_of``: the day's
    ``DayRuns`` (its runs side by side); ``ahead``: (prefill, decode) -> its pending run, started before the
    search asked (``static_ahead``), taken when the search reaches that point."""
    runs: list[dict] = []
    ahead = dict(ahead or {})

    def fits(p: int, d: int) -> bool:
        if (p, d) not in ahead:
            ahead[p, d] = (runs_of.submit(_static, p, d, heartbeat_s, goal, windows=windows) if runs_of else
                           _Ready(lambda: _static(profile, requests, slo, p, d, heartbeat_s, goal, windows=windows)))
        runs.append(ahead.pop((p, d)).get())
        return meets(runs[-1], goal)

    p, d = max(1, hint[0]), max(1, hint[1])
    while not fits(p, d):
        p, d = p + max(1, p // 4), d + max(1, d // 4)
    for role in ("prefill", "decode"):
        def at(n: int) -> tuple[int, int]:
            return (n, d) if role == "prefill" else (p, n)

        hi = p if role == "prefill" else d  # meets; lo fails (0: never run)
        step, lo = 1, 0
        while hi - step >= 1:
            if not fits(*at(hi - step)):
                lo = hi - step
                break
            hi, step = hi - step, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(*at(mid)):
                hi = mid
            else:
                lo = mid
        if role == "prefill":
            p = hi
        else:
            d = hi
    best = min((r for r in runs if meets(r, goal)), key=lambda r: (r["workers"], -r["slo_attainment"]))
    return best, runs


def recheck_static(profile, requests, slo, known: dict, heartbeat_s: float, windows=()) -> tuple[dict, list[dict]]:
    """A saved static search's answer, its peak run again: the simulator may have changed since."""
    peak = known["static_peak"]
    again = _static(profile, requests, slo, peak["prefill"], peak["decode"], heartbeat_s, windows=windows)
    if (again["slo_attainment"], again["worker_hours"]) != (peak["slo_attainment"], peak["worker_hours"]):
        raise ValueError(f"the saved static peak {peak['prefill']}+{peak['decode']} now gives attainment "
                         f"{again['slo_attainment']} and {again['worker_hours']} worker-h (saved: "
                         f"{peak['slo_attainment']}, {peak['worker_hours']}): the simulator changed; search again")
    return again, [again if r is peak or r == peak else r for r in known["static"]]


def static_hint(run: dict, quantile: float = 0.95) -> tuple[int, int]:
    """Where to start the static search: the planner run's decided counts at their ``quantile`` over
    the day, per role (its peak is a burst's or a churn's, often several times static's)."""
    counts = {}
    for role in ("prefill", "decode"):
        xs = sorted(d[role] for d in run["decisions"])
        counts[role] = xs[min(len(xs) - 1, int(quantile * len(xs)))] if xs else 1
    return counts["prefill"], counts["decode"]


# The planner's knobs swept for the trade-off curve, and two ablations at the headline target; each in a
# real day's seconds (lookahead: one real cold start), then compressed with the day.
# ``base``: PlannerConfig fields over its defaults, in every variant (``pdserve bench sim --planner-config``).
def planner_variants(profile: WorkerProfile, scale: DayScale, targets, headline_target: float,
                     ablations: bool, base: dict | None = None) -> dict[str, PlannerConfig]:
    base = dict(base or {})
    out = {f"target {t}": PlannerConfig(**{**base, "target_utilisation": t}) for t in targets}
    if ablations:
        out["no lookahead"] = dataclasses.replace(out[f"target {headline_target}"], lookahead_s=0.0)
        out["no warm pool"] = PlannerConfig(**{**base, "target_utilisation": headline_target, "warm_min": 0,
                                               "burst_factor": 1.0, "warm_fraction": 0.0})
    # the lookahead is one cold start unless ``base`` sets it
    own_lookahead = "lookahead_s" in base
    return {name: scale.planner(c, None if name == "no lookahead" or own_lookahead else profile.cold_start_s)
            for name, c in out.items()}


class _Ready:
    """A run computed when its result is first asked for (``DayRuns`` with one job: the order of old)."""

    def __init__(self, call) -> None:
        self._call, self._done, self._result = call, False, None

    def get(self):
        if not self._done:
            self._result, self._done = self._call(), True
        return self._result


_DAY: tuple = ()  # (profile, requests, slo) of the DayRuns whose forked processes run it


def _in_child(name: str, args: tuple, kwargs: dict):
    return globals()[name](*_DAY, *args, **kwargs)


class DayRuns:
    """One day's simulations (planner runs, static points), ``jobs`` at a time. With one job each runs in
    this process when its result is asked for. With more, each runs in a process forked from this one, so
    it inherits the day (a rate-64 day is 1.5M requests) instead of having it pickled to it; a process
    runs one simulation and exits (its ~10 GB go back before the next starts). The runs are independent
    and seeded: the results are the same for any ``jobs``. ``submit(fn, *args)`` calls
    ``fn(profile, requests, slo, *args)``; its ``get()`` waits for the result."""

    def __init__(self, profile, requests, slo, jobs: int = 1) -> None:
        if jobs < 1:
            raise ValueError("jobs must be >= 1")
        self._day, self._pool = (profile, requests, slo), None
        if jobs > 1:
            global _DAY
            _DAY = self._day
            self._pool = multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=1)

    def submit(self, fn, *args, **kwargs):
        if self._pool is None:
            return _Ready(lambda: fn(*self._day, *args, **kwargs))
        return self._pool.apply_async(_in_child, (fn.__name__, args, kwargs))

    def __enter__(self) -> "DayRuns":
        return self

    def __exit__(self, *_) -> None:
        global _DAY
        if self._pool is not None:  # every result wanted has been taken: what still runs is an unused static point
            self._pool.terminate()
            self._pool.join()
            _DAY = ()


def static_ahead(start: tuple[int, int]) -> list[tuple[int, int]]:
    """The points a search from a known ``start`` runs if its answer is ``start``: it, one prefill fewer and
    one decode fewer (started together with ``--jobs``)."""
    p, d = start
    return [(p, d)] + [(a, b) for a, b in ((p - 1, d), (p, d - 1)) if a >= 1 and b >= 1]


def run_autoscale(profile: WorkerProfile, requests, slo: SLO, scale: DayScale, planner_targets, threshold_targets,
                  headline_target: float, ablations: bool = True, static_start: tuple[int, int] | None = None,
                  static_known: dict | None = None, static_windows=(), planner_base: dict | None = None,
                  forecast=None, jobs: int = 1) -> dict:
    """The planner at several target utilisations (and, at the headline target, without its trend
    lookahead and without a warm pool), the HPA-like threshold rule at several targets, and static
    provisioning searched from the headline planner's 95th-percentile counts to the smallest meeting
    99% (over the day, and in each of ``static_windows``, the day's bursts, when given: peak provisioning):
    the trade-off curve. ``static_start``: start the static search there instead (a known answer
    costs three runs: it, one prefill fewer, one decode fewer). ``static_known``: a saved run's ``autoscale``
    object on the same trace (``static_from`` checks that): its search is taken, its peak re-run once here
    and refused if the simulator now gives it another attainment.
    ``profile``: the real one; its start-up times are compressed with the day here. ``planner_base``: PlannerConfig
    fields over its defaults in every planner run; ``forecast``: a ``DemandForecast`` every planner run reads.
    ``jobs``: runs side by side (``DayRuns``); with a known start its three static points start with the
    headline planner."""
    day = scale.profile(profile)
    variants = planner_variants(profile, scale, planner_targets, headline_target, ablations, planner_base)
    # the headline planner and the static search first: they are the headline ratio, and a run cut short
    # for time is more use with them than with the sweep
    headline_name = f"target {headline_target}"
    order = [headline_name] + [n for n in variants if n != headline_name]
    with DayRuns(day, requests, slo, jobs) as runs:
        pending = {name: runs.submit(_autoscaled, scale, "planner", variants[name], windows=static_windows,
                                     forecast=forecast) for name in order[:1]}
        if static_known:
            recheck = runs.submit(recheck_static, static_known, scale.heartbeat_s, static_windows)
        ahead = {point: runs.submit(_static, *point, scale.heartbeat_s, 0.99, windows=static_windows)
                 for point in (static_ahead(static_start) if static_start and not static_known and jobs > 1 else [])}
        pending.update((name, runs.submit(_autoscaled, scale, "planner", variants[name], windows=static_windows,
                                          forecast=forecast)) for name in order[1:])
        pending_threshold = [(target, runs.submit(_autoscaled, scale, "threshold", threshold=target,
                                                  windows=static_windows)) for target in threshold_targets]
        planner: dict = {}
        for name in order:
            config, run = variants[name], pending[name].get()
            run.update(variant=name, target_utilisation=config.target_utilisation, lookahead_s=config.lookahead_s,
                       burst_factor=config.burst_factor, warm_min=config.warm_min)
            planner[name] = run
            _log(f"planner {name}: attainment {run['slo_attainment']}{bursts_text(run)}, {run['worker_hours']} "
                 f"worker-h, peak {run['peak']}, by state {run['worker_hours_by_state']}")
            if name == headline_name and static_known:
                peak, static = recheck.get()
            elif name == headline_name:
                peak, static = static_peak(day, requests, slo, static_start or static_hint(run),
                                           heartbeat_s=scale.heartbeat_s, windows=static_windows,
                                           runs_of=runs, ahead=ahead)
                _log(f"static peak {peak['prefill']}+{peak['decode']}: {peak['worker_hours']} worker-h")
        threshold = []
        for target, pending_run in pending_threshold:
            run = pending_run.get()
            run["target"] = target
            threshold.append(run)
            _log(f"threshold rule target {target}: attainment {run['slo_attainment']}{bursts_text(run)}, "
                 f"{run['worker_hours']} worker-h")
    headline = planner[headline_name]
    planner = [planner[n] for n in variants]
    return {"static": static, "static_peak": peak, "planner": planner, "threshold": threshold,
            "headline_run": headline,
            "day_scale": {"period_s": scale.period_s, "k": round(scale.k, 3), "tick_s": round(scale.tick_s, 4),
                          "heartbeat_s": round(scale.heartbeat_s, 4), "burst_s": round(scale.burst_s, 4),
                          "cold_start_s": round(day.cold_start_s, 4), "warm_start_s": round(day.warm_start_s, 4),
                          "real_cold_start_s": profile.cold_start_s}}
