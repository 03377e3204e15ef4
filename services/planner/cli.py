"""``pdserve planner``'s command line: flags -> the planner, its signal reader and an actuator."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import time

from services import telemetry
from services.planner.forecast import DemandForecast
from services.planner.policy import Capacity, Planner, PlannerConfig
from services.planner.service import EmitActuator, LocalActuator, run_loop
from services.planner.signals import SignalReader
from services.registry import connect_redis
from services.sim.autoscale import capacity_of
from services.sim.profiles import load_profile


def _capacity(args) -> Capacity:
    base = capacity_of(load_profile(args.profile))
    return Capacity(prefill_tokens_per_s=args.prefill_tokens_per_s or base.prefill_tokens_per_s,
                    kv_blocks=args.kv_blocks or base.kv_blocks, max_num_seqs=args.max_num_seqs or base.max_num_seqs)


async def _main(args) -> int:
    config = PlannerConfig(target_utilisation=args.target_utilisation, kv_target=args.kv_target,
                           lag_target_s=args.lag_target_s, slo_target=args.slo_target,
                           slo_min_requests=args.slo_min_requests, staffing_beta=args.staffing_beta,
                           kv_staffing_beta=args.kv_staffing_beta,
                           down_after_s=args.down_after_s, down_step=args.down_step, down_every_s=args.down_every_s,
                           down_floor_quantile=args.down_floor_quantile, warm_fraction=args.warm_fraction,
                           burst_factor=args.burst_factor, burst_utilisation=args.burst_utilisation,
                           burst_kv_target=args.burst_kv_target,
                           idle_to_zero_s=args.idle_to_zero_s, lookahead_s=args.lookahead_s,
                           forecast_level_s=args.forecast_level_s,
                           trend_window_s=args.trend_window_s, boost=args.boost, boost_every_s=args.boost_every_s,
                           boost_only_while_missing=args.boost_only_while_missing,
                           slo_window_s=args.slo_window_s, slo_sigmas=args.slo_sigmas,
                           warm_min=args.warm_min, warm_confirm_s=args.warm_confirm_s,
                           warm_min_ahead_s=args.warm_min_ahead_s,
                           standby_hold_s=args.standby_hold_s, up_margin=args.up_margin,
                           seq_target=args.seq_target, trend_autocorrelation=args.trend_autocorrelation,
                           held_level_recent=args.held_level_recent, down_hold_recent=args.down_hold_recent,
                           local_prefill_below=args.local_prefill_below,
                           min_prefill=args.min_prefill,
                           min_decode=args.min_decode, max_workers=args.max_workers)
    forecast = None
    if args.forecast_file:
        forecast = DemandForecast.load(args.forecast_file, 86_400.0, args.forecast_bin_s, args.forecast_days)
        print(f"forecast: {len(forecast.days)} recorded days in {args.forecast_file}", flush=True)
    planner = Planner(config, _capacity(args), forecast)
    redis = await connect_redis(args.redis_url)
    gauge = None
    if args.metrics_port >= 0:
        from prometheus_client import Gauge

        gauge = Gauge("pdserve_planner_desired_replicas", "The planner's decision: workers wanted per role "
                      "(prefill, decode) and warm standbys (warm).", ["role"])
        address = telemetry.start_metrics_server(args.host, args.metrics_port)
        print(f"planner metrics on {address}", flush=True)
    model = args.model or "default"
    if args.actuate == "local":
        actuator = LocalActuator(redis, model, args.redis_url, shlex.split(args.worker_args), gauge,
                                 echo=lambda name, line: print(f"[{name}] {line}", flush=True))
    else:
        actuator = EmitActuator(redis, model, gauge)
    # the forecast is by time of day: the signals are read on the wall clock
    reader = SignalReader(redis, args.model, args.ttft_slo, args.itl_slo, args.scrape,
                          **({"clock": time.time} if forecast is not None else {}))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stopping.set)
    try:
        await run_loop(reader, planner, actuator, args.interval, args.ticks, stopping, args.forecast_file or None)
    finally:
        actuator.close()
        await redis.aclose()
    return 0


def run(args) -> int:
    if args.interval <= 0 or args.ticks < 0:
        raise ValueError("--interval must be > 0 and --ticks >= 0")
    if not 0 < args.forecast_bin_s <= 86_400 or args.forecast_days < 1:
        raise ValueError("--forecast-bin-s must be in (0, 86400] and --forecast-days >= 1")
    return asyncio.run(_main(args))


def add_parser(sub) -> None:
    p = sub.add_parser("planner", help="the autoscaling planner: decide prefill/decode/warm counts from Redis and "
                                       "Prometheus signals; emit them (Kubernetes) or scale local workers",
                       description=__doc__ + "\n\nSee docs/autoscaling.md for the rule and its KEDA mapping.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--model", default=None, help="plan for the workers serving this model (default: all)")
    p.add_argument("--actuate", choices=["emit", "local"], default="emit",
                   help="emit: print/publish decisions (KEDA scales on them); local: start and drain worker "
                        "processes on this machine")
    p.add_argument("--worker-args", default="", help="local: flags for the workers it starts, one quoted string "
                                                     "(e.g. \"--kv-cache-gb 0.5 --threads 1\")")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between decisions")
    p.add_argument("--ticks", type=int, default=0, help="stop after this many decisions (0: run until SIGTERM)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="/metrics port for pdserve_planner_desired_replicas (0: a free one; -1: off)")
    p.add_argument("--scrape", action="append", default=[], metavar="HOST:PORT",
                   help="more /metrics endpoints to read (the router's, for per-request TTFT); repeatable")
    p.add_argument("--profile", default="cpu",
                   help="worker capacities from this calibration profile (cpu, h100, h100-measured, h200)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=0.0, help="override: one prefill worker's rate")
    p.add_argument("--kv-blocks", type=int, default=0, help="override: one decode worker's KV blocks")
    p.add_argument("--max-num-seqs", type=int, default=0, help="override: one decode worker's batch limit")
    p.add_argument("--ttft-slo", type=float, default=2.5, help="seconds (use a histogram bucket bound)")
    p.add_argument("--itl-slo", type=float, default=0.1, help="seconds (use a histogram bucket bound)")
    p.add_argument("--target-utilisation", type=float, default=0.6)
    p.add_argument("--kv-target", type=float, default=0.7)
    p.add_argument("--staffing-beta", type=float, default=0.0,
                   help="square-root staffing for prefill: a + beta x sqrt(a) workers for an offered load of a "
                        "workers (the utilisation rises with the pool); 0: the fixed --target-utilisation")
    p.add_argument("--kv-staffing-beta", type=float, default=0.0,
                   help="the same for decode's KV blocks in use (0: the fixed --kv-target)")
    p.add_argument("--lag-target-s", type=float, default=1.0,
                   help="prefill's queue lag (queued prompt tokens over the ready workers' tokens/s) over this many "
                        "seconds orders workers to clear the backlog")
    p.add_argument("--slo-target", type=float, default=0.99)
    p.add_argument("--slo-min-requests", type=int, default=20,
                   help="judge a window's SLO attainment only with at least this many requests in it")
    p.add_argument("--slo-window-s", type=float, default=120.0,
                   help="SLO attainment is judged over the requests of this window")
    p.add_argument("--slo-sigmas", type=float, default=2.0,
                   help="a missed SLO: misses over what --slo-target allows by this many binomial std devs")
    p.add_argument("--boost", type=float, default=1.25, help="workers x this when a window misses the SLO target")
    p.add_argument("--boost-every-s", type=float, default=30.0, help="at most one SLO boost per role this often")
    p.add_argument("--boost-only-while-missing", action="store_true",
                   help="boost on missed TTFTs only while the queue lags or the last window missed (not on a "
                        "cleared backlog's misses)")
    p.add_argument("--lookahead-s", type=float, default=0.0,
                   help="read rising demand this far ahead (set it to a worker's cold start; 0: react to now)")
    p.add_argument("--trend-window-s", type=float, default=300.0, help="the window the demand's slope is fitted over")
    p.add_argument("--down-after-s", type=float, default=150.0,
                   help="hysteresis before scaling down (a little over one cold start)")
    p.add_argument("--down-floor-quantile", type=float, default=1.0,
                   help="a scale-down goes to this quantile of the hysteresis window's needs (1: the highest)")
    p.add_argument("--down-step", type=float, default=0.25, help="at most this share of a role released per decision")
    p.add_argument("--down-every-s", type=float, default=0.0,
                   help="at most one scale-down per role this often (a drained worker's prefix cache goes with it)")
    p.add_argument("--burst-factor", type=float, default=1.5,
                   help="the warm pool covers a jump of demand by this factor (1: warm_min standbys only)")
    p.add_argument("--burst-utilisation", type=float, default=0.9,
                   help="the utilisation the SLO survives during that burst (sizes the warm pool)")
    p.add_argument("--burst-kv-target", type=float, default=0.7,
                   help="decode's KV in that burst held to this share of the blocks (0: --burst-utilisation)")
    p.add_argument("--warm-fraction", type=float, default=0.0, help="and at least this share of the active workers warm")
    p.add_argument("--warm-min", type=int, default=1, help="standby workers kept at least")
    p.add_argument("--warm-confirm-s", type=float, default=0.0,
                   help="the warm pool grows only for a need that held this long (it shrinks at once; 0: at once)")
    p.add_argument("--standby-hold-s", type=float, default=0.0,
                   help="for the pool's actuator (on Kubernetes the standby deployment's scale-down delay): a "
                        "drained worker parks as a standby, and one over the pool's target goes after this long")
    p.add_argument("--trend-autocorrelation", action="store_true",
                   help="the trend test's standard error from the demand windows' lag-1 autocorrelation (a slow "
                        "swing is not read as a rise); off: the windows taken as independent")
    p.add_argument("--held-level-recent", action="store_true",
                   help="decode's KV blocks and sequences read at least the lower of the last two windows, not only "
                        "the trend window's trimmed mean (blocks held now are held now); off: the mean alone")
    p.add_argument("--down-hold-recent", action="store_true",
                   help="a role scales down only once the lower of the last two windows' demand needs fewer "
                        "workers too (a burst's windows hold its workers); off: the trend window's trimmed mean alone")
    p.add_argument("--seq-target", type=float, default=0.0,
                   help="decode's running and waiting sequences held to this share of --max-num-seqs "
                        "(0: --target-utilisation)")
    p.add_argument("--up-margin", type=float, default=0.0,
                   help="a role scales up for its demand only once the need stands this many workers (under 1) "
                        "over those running (0: at once); the queue lag and missed SLOs scale up at once")
    p.add_argument("--forecast-file", default="",
                   help="record the demand by time of day (UTC) in this JSON file and, once a day is recorded, "
                        "read the median of the recorded days ahead instead of the demand's trend (set "
                        "--lookahead-s to a cold start); kept across restarts")
    p.add_argument("--forecast-bin-s", type=float, default=300.0, help="the forecast's bin, seconds (300)")
    p.add_argument("--forecast-days", type=int, default=7, help="the recorded days the forecast keeps (7)")
    p.add_argument("--warm-min-ahead-s", type=float, default=0.0,
                   help="with --forecast-file: keep --warm-min's standbys only while the forecast's demand over the "
                        "next this many seconds stands over the last as many's (0: always)")
    p.add_argument("--forecast-level-s", type=float, default=0.0,
                   help="with --forecast-file: the demand now is the forecast's, scaled by the demand seen over "
                        "this many seconds against the forecast's for them (0: the trend window's mean)")
    p.add_argument("--local-prefill-below", type=float, default=0.0,
                   help="no prefill worker while the prefill demand is under this share of one: the decode "
                        "workers prefill it (0: always at least one prefill worker when there is demand)")
    p.add_argument("--idle-to-zero-s", type=float, default=900.0)
    p.add_argument("--min-prefill", type=int, default=0)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=64)
    p.set_defaults(func=run)
