"""``pdserve bench frontdoor``: the gateway under a burst of N concurrent clients, and what it adds per chunk.

Brings up the stack with ``pdserve up``'s defaults (embedded Redis, one prefill
and one decode worker, router, gateway) and runs two phases with the shared
load generator (services/bench/load.py):

1. **Burst**: N clients at once (``--clients``), half streaming and half waiting
   for JSON, chat requests with short outputs, priorities cycling through the
   tiers. Each request ends ``completed``, ``refused`` (429 or 503 with
   Retry-After: the client was told when to come back) or ``other`` (anything
   else: an error, a stream without its final event, a dropped connection).
   Meanwhile a watch (process_watch.py) samples every process's Redis
   connections (CLIENT LIST) and the gateway's memory and CPU, keeping the peaks.
2. **Added latency per chunk** at ``--latency-streams`` open streams: that
   many streaming clients in a closed loop (each opens its next stream when its
   last one ends), so that many streams stay open. Every chunk's SSE ``id:`` (its
   entry id in the request's result stream) is matched with the moment a
   separate process reading the result streams straight from Redis
   (result_tap.py) got the same entry; the difference is what the gateway adds
   (delivery stream, fan-out, formatting, HTTP). The figures count the chunks
   written once every client had its first stream open (the ramp is reported
   apart). Both clocks are this machine's. Each side's time is when the bytes
   reached its socket, as the kernel stamped them (socket_time.py), so neither
   reader's own lateness counts: the load generator reads every stream in one
   event loop on the same cores as the stack, and by its read times (reported
   beside, ``added_by_reads_*``) its waits for a core were most of the slowest
   chunks' added latency. While it times chunks it
   runs no full garbage collection (``--client-gc quiet``: one such collection
   walked every chunk record kept so far and stopped that loop for 94 ms in the
   steady window of a measured run); ``--client-loop uvloop`` is an option.

Goals on this machine: ``other`` = 0 at N = 10,000, the gateway on at most 32
Redis connections, and an added p99 per chunk of at most 20 ms at 1,000 open
streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

from services import event_loop, front_first, sched_priority, sched_stat
from services.bench import result_tap
from services.bench import results as result_files
from services.bench.http_client import Connection
from services.bench.load import (
    OpenAIClient,
    OpenAIRequest,
    closed_loop,
    open_loop,
    outcomes,
)
from services.bench.stats import percentile as pct
from services.gateway import fanout_probe, frontdoor_probe
from services.loop_lag import LoopLag
from services.queue.config import DEFAULT_TIERS
from services import up_defaults

_WORDS = ("river stone light garden window paper engine market silver forest music winter harbor signal "
          "letter mountain yellow planet bridge candle orange theory coffee island rocket").split()


def workload(n: int, max_tokens: int, seed: int, stream_share: float = 0.5,
             timeout_s: float | None = None) -> list[OpenAIRequest]:
    """Short distinct chat prompts; every other request streams; priorities cycle through the tiers."""
    rng = random.Random(seed)
    every = max(1, round(1 / stream_share)) if stream_share > 0 else 0
    return [OpenAIRequest("chat", f"Request {i}: name a {rng.choice(_WORDS)} and a {rng.choice(_WORDS)}.",
                          max_tokens, stream=bool(every) and i % every == 0, priority=DEFAULT_TIERS[i % 3],
                          timeout_s=timeout_s)
            for i in range(n)]


@contextlib.contextmanager
def client_gc(mode: str):
    """The load generator's collector while it times chunks. ``quiet``: what the burst left is collected and
    frozen, and no full collection runs (each walked every chunk record kept so far, stopping the loop that
    reads all 1,000 streams); young collections go on. ``default``: Python's."""
    if mode != "quiet":
        yield
        return
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(before[0], before[1], 1_000_000)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


async def burst(args, stack, model: str, host: str, port: int) -> dict:
    from services.bench.process_watch import ProcessWatch

    pids = {name: p.proc.pid for name, p in stack.procs.items()}
    client = OpenAIClient(host, port, model, timeout_s=args.timeout + 60)
    items = workload(args.clients, args.max_tokens, args.seed, timeout_s=args.timeout)
    watch = ProcessWatch(stack.redis_url, pids)
    idle_rss = watch.rss_mib("gateway")
    _log(f"burst: {args.clients} clients at once ({sum(i.stream for i in items)} streaming), "
         f"max_tokens {args.max_tokens}")
    with watch:
        samples, wall = await open_loop(client.send, items, rate=args.ramp_rate or math.inf, seed=args.seed)
    counts = outcomes(samples)
    gw = watch.peaks.processes["gateway"]
    done = [s for s in samples if s.ok]
    result = {
        "clients": args.clients, **counts, "wall_s": round(wall, 2),
        "errors": sorted({s.error for s in samples if s.outcome == "other"})[:5],
        "peak_open_requests": client.peak_open,
        "redis_connections_peak": {name: p.redis_connections for name, p in watch.peaks.processes.items()},
        "redis_connections_peak_other": watch.peaks.other_redis_connections,
        "gateway_rss_mib_idle": round(idle_rss, 1), "gateway_rss_mib_peak": round(gw.rss_mib, 1),
        "gateway_rss_kib_per_open_request": round((gw.rss_mib - idle_rss) * 1024 / max(1, client.peak_open), 1),
        "gateway_cpu_percent_peak": round(gw.cpu_percent, 1),
        "gateway_cpu_seconds": round(gw.cpu_seconds, 2),
        "gateway_cpu_ms_per_request": round(gw.cpu_seconds * 1e3 / max(1, len(samples)), 2),
        "requests_s": round(len(done) / wall, 2) if wall else None,
        "ttft_ms_p50": pct([s.ttft for s in done], 50) * 1e3, "ttft_ms_p99": pct([s.ttft for s in done], 99) * 1e3,
        "e2e_ms_p50": pct([s.e2e for s in done], 50) * 1e3, "e2e_ms_p99": pct([s.e2e for s in done], 99) * 1e3,
        "watch_samples": watch.peaks.samples,
    }
    _log(f"  completed {counts['completed']}, refused {counts['refused']}, other {counts['other']} in {wall:.1f} s; "
         f"gateway: {result['redis_connections_peak'].get('gateway')} Redis connections at peak, "
         f"{gw.rss_mib:.0f} MiB, {gw.cpu_percent:.0f} % CPU at peak")
    return result


async def added_latency(args, stack, model: str, host: str, port: int) -> dict:
    """A closed loop of ``latency_streams`` streaming clients (each opens its next stream when one ends), so
    that many streams stay open; chunks written once every client had its first stream open are compared."""
    tap = result_tap.ResultTap(stack.redis_url, source=args.tap).start()
    admitted = {"n": 0, "all_open_at": math.inf}

    pids = {name: p.proc.pid for name, p in stack.procs.items()} | {"load generator": os.getpid()}
    sched: dict[str, dict] = {}
    loops = ("gateway", "load generator")  # one event loop each, on the main thread

    def on_request_id(rid: str) -> None:
        tap.follow(rid)
        admitted["n"] += 1
        if admitted["n"] == args.latency_streams:
            admitted["all_open_at"] = time.time()
            sched.update({name: sched_stat.read(pid) for name, pid in pids.items()})
            sched.update({f"{name} (loop thread)": sched_stat.read(pids[name], main_thread=True) for name in loops})

    client = OpenAIClient(host, port, model, record_chunks=True, on_request_id=on_request_id,
                          timeout_s=args.timeout + 60, socket_times=True)
    n_requests = args.latency_requests or 2 * args.latency_streams
    items = workload(n_requests, args.latency_max_tokens, args.seed + 1, stream_share=1.0, timeout_s=args.timeout)
    _log(f"added latency: {args.latency_streams} streaming clients in a closed loop ({n_requests} requests, "
         f"max_tokens {args.latency_max_tokens}), each chunk against a separate process reading Redis ({args.tap})")
    await asyncio.sleep(1.0)  # the tap's process is up
    client_lag = LoopLag().start()  # the client side's own lateness: a slow reader inflates the figure
    with client_gc(args.client_gc):
        samples, wall = await closed_loop(client.send, items, clients=args.latency_streams)
    client_lag.stop()
    ended_at = time.time()
    # each process's CPU and run-queue wait over the steady window: is a late loop busy, or waiting for a core?
    sched = {**{name: sched_stat.delta(sched.get(name), sched_stat.read(pid)) for name, pid in pids.items()},
             **{f"{name} (loop thread)": sched_stat.delta(sched.get(f"{name} (loop thread)"),
                                                          sched_stat.read(pids[name], main_thread=True))
                for name in loops}}
    direct = await asyncio.to_thread(tap.stop)
    # Two clocks per chunk on each side: when its bytes reached the process's socket (the kernel's stamp) and when
    # the process had read them. The added latency is socket against socket: what the gateway's path adds before
    # the client could read, without either reader's own lateness (the load generator reads 1,000 sockets in one
    # loop on the stack's two cores). The same by read times, the figure of the sessions before, is kept beside it.
    steady, every, by_reads, via_gateway, via_redis, client_late, joined = [], [], [], [], [], [], []
    for s in samples:
        for entry_id, read_at, at_socket in s.chunks:
            tapped = direct.get((s.request_id, entry_id))
            if tapped is None:
                continue
            tap_stamp, tap_read = tapped
            written = int(entry_id.split("-")[0]) / 1e3  # the entry id is Redis's clock at the XADD, in ms
            added = (at_socket - tap_stamp) * 1e3
            every.append(added)
            if written >= admitted["all_open_at"]:
                steady.append(added)
                by_reads.append((read_at - tap_read) * 1e3)
                client_late.append((read_at - at_socket) * 1e3)
                joined.append((s.request_id, entry_id, tap_stamp, at_socket))
                via_gateway.append((at_socket - written) * 1e3)
                via_redis.append((tap_stamp - written) * 1e3)
    counts = outcomes(samples)
    result = {
        "streams": args.latency_streams, "requests": n_requests, **counts, "peak_open_streams": client.peak_open,
        "errors": sorted({s.error for s in samples if s.outcome == "other"})[:5],
        "wall_s": round(wall, 2), "chunks_compared": len(steady), "chunk_times": "socket", "tap": args.tap,
        "added_ms_p50": pct(steady, 50), "added_ms_p90": pct(steady, 90), "added_ms_p99": pct(steady, 99),
        "added_by_reads_ms_p50": pct(by_reads, 50), "added_by_reads_ms_p90": pct(by_reads, 90),
        "added_by_reads_ms_p99": pct(by_reads, 99),
        "client_read_late_ms_p50": pct(client_late, 50), "client_read_late_ms_p99": pct(client_late, 99),
        "gateway_since_write_ms_p50": pct(via_gateway, 50), "gateway_since_write_ms_p99": pct(via_gateway, 99),
        "direct_since_write_ms_p50": pct(via_redis, 50), "direct_since_write_ms_p99": pct(via_redis, 99),
        "chunks_compared_incl_ramp": len(every), "added_ms_p50_incl_ramp": pct(every, 50),
        "added_ms_p99_incl_ramp": pct(every, 99),
        "steady_window_s": round(ended_at - admitted["all_open_at"], 2) if steady else None,
        "sched_steady": sched,
    }
    if args.probe_dir:
        await asyncio.sleep(1.5)  # the gateway's probe writes what is new every second
        result["probe"] = frontdoor_probe.breakdown(joined, fanout_probe.load(args.probe_dir), client_lag.samples,
                                                    admitted["all_open_at"], ended_at, client_lag.gc_pauses)
    _log(f"  {len(steady)} chunks with every client's stream open: added p50 {result['added_ms_p50']:.1f} ms, "
         f"p99 {result['added_ms_p99']:.1f} ms at the sockets (incl. the ramp: p99 "
         f"{result['added_ms_p99_incl_ramp']:.1f} ms; by the readers' read times: p99 "
         f"{result['added_by_reads_ms_p99']:.1f} ms, the load generator reading p99 "
         f"{result['client_read_late_ms_p99']:.1f} ms after the bytes arrived)")
    return result


async def _bench(args, stack) -> dict:
    from services.open_files import raise_open_file_limit

    limit = raise_open_file_limit()
    if 0 < limit < args.clients + 100:
        _log(f"warning: this process may open {limit} files; {args.clients} clients need more")
    host, port = stack.gateway_address.rsplit(":", 1)
    probe = await Connection(host, int(port)).request("GET", "/v1/models")
    model = json.loads(probe.body)["data"][0]["id"]
    out = {"burst": await burst(args, stack, model, host, int(port))}
    if args.latency_streams:
        out["latency"] = await added_latency(args, stack, model, host, int(port))
    b, lat = out["burst"], out.get("latency")
    out["goals"] = {
        "other_is_zero": b["other"] == 0,
        "gateway_redis_connections_le_32": (b["redis_connections_peak"].get("gateway") or 0) <= 32,
        "added_p99_chunk_ms_le_20": None if lat is None or math.isnan(lat["added_ms_p99"])
        else lat["added_ms_p99"] <= 20.0,
    }
    out["config"] = {"clients": args.clients, "max_tokens": args.max_tokens, "ramp_rate": args.ramp_rate,
                     "client_timeout_s": args.timeout,
                     "latency_streams": args.latency_streams, "latency_requests": args.latency_requests,
                     "latency_max_tokens": args.latency_max_tokens,
                     "model": args.model, "dtype": args.dtype, "threads_per_worker": args.threads,
                     "quantization": args.quantization,
                     "seed": args.seed, "front_first": args.front_first, "worker_nice": args.worker_nice, "front_nice": args.front_nice, "front_realtime": args.front_realtime, "realtime_gateway": not args.no_realtime_gateway, "worker_policy": args.worker_policy,
                     "engine_nice": args.engine_nice, "front_slice_us": args.front_slice_us,
                     "gateway_args": args.gateway_arg, "client_loop": args.client_loop, "client_gc": args.client_gc, "stack": getattr(args, "stack", None)}
    return out


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if args.clients < 1 or args.max_tokens < 1 or args.latency_streams < 0 or args.latency_max_tokens < 1:
        raise ValueError("clients and max-tokens must be >= 1, latency-streams >= 0")
    if args.latency_requests and args.latency_requests < args.latency_streams:
        raise ValueError("latency-requests must be at least latency-streams (every client sends one)")
    if args.engine_nice is not None and not 0 <= args.engine_nice <= 19:
        raise ValueError(f"engine-nice must be 0-19; got {args.engine_nice}")
    choice = _up_choice(args)
    args.engine_nice = choice.engine_nice
    spec = StackSpec(prefill=choice.prefill, decode=choice.decode, model=args.model, dtype=args.dtype,
                     quantization=choice.quantization, threads=choice.threads, router_args=choice.router_args,
                     transport=args.transport, gateway=True, gateway_args=list(args.gateway_arg),
                     front_first=choice.front_first, engine_nice=choice.engine_nice,
                     realtime_gateway=choice.realtime_gateway)
    args.stack = (f"pdserve up defaults: embedded Redis, {choice.prefill} prefill, {choice.decode} decode, router, "
                  f"gateway; chose: {choice.summary()}")
    _log(f"starting the stack ({args.stack})")
    started = time.perf_counter()
    args.probe_dir = None if args.no_probe else tempfile.mkdtemp(prefix="pdserve-fanout-probe-")
    if args.probe_dir:
        os.environ[fanout_probe.ENV] = args.probe_dir  # the gateway inherits it
    with LocalStack(spec) as stack:
        os.environ.pop(fanout_probe.ENV, None)
        _log(f"  ready in {time.perf_counter() - started:.0f} s")
        _schedule(args, stack)
        try:
            result = event_loop.run(_bench(args, stack), args.client_loop)
        finally:
            if args.probe_dir:
                shutil.rmtree(args.probe_dir, ignore_errors=True)
        trouble = stack.trouble()
    result["log_trouble_lines"] = len(trouble)  # WARNING / ERROR / Traceback lines the stack printed
    result["log_trouble_sample"] = trouble[:5]
    result_files.save("frontdoor", result, args)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def _up_choice(args):
    """What `pdserve up` would run here for what the flags leave open (services/up_defaults.py): the bench
    measures the stack a user gets."""
    from pathlib import Path

    from services.engine.model_source import default_model_path
    from services.errors import ModelNotFoundError

    try:
        path = Path(args.model).expanduser() if args.model else default_model_path()
    except ModelNotFoundError:
        path = None  # the workers say so, with how to install it
    gguf = up_defaults.gguf_servable(path) if args.quantization is None else (False, "")
    return up_defaults.choose(os.cpu_count() or 1, threads=args.threads, quantization=args.quantization, gguf=gguf,
                              front_first=args.front_first, engine_nice=args.engine_nice,
                              realtime_gateway=False if args.no_realtime_gateway else None)


def _schedule(args, stack) -> None:
    """The scheduling knobs on top of the stack's own (``--scheduling``): the workers', then the light
    processes' (gateway, router, embedded Redis, and this process: the clients and, spawned later, the tap)."""
    if args.front_first:  # the clients stand in for other machines': they get what the gateway gets
        for line in front_first.apply("load generator", os.getpid()):
            _log(f"  {line}")
    workers = [p.proc.pid for name, p in stack.procs.items() if name.startswith(("prefill", "decode"))]
    redis = getattr(stack.server, "_process", None)
    light = [p.proc.pid for name, p in stack.procs.items() if not name.startswith(("prefill", "decode"))]
    light += [*([redis.pid] if redis else []), os.getpid()]
    for pid in workers:
        if args.worker_nice:
            sched_priority.renice(pid, args.worker_nice)
        if args.worker_policy != "other":
            sched_priority.set_policy(pid, _POLICIES[args.worker_policy])
    for pid in light:
        if args.front_nice:
            sched_priority.renice(pid, args.front_nice)
        if args.front_realtime:
            sched_priority.realtime(pid)
        if args.front_slice_us:
            sched_priority.set_slice(pid, int(args.front_slice_us * 1000))
    names = ("worker_nice", "worker_policy", "front_nice", "front_realtime", "front_slice_us")
    knobs = {k: getattr(args, k) for k in names if getattr(args, k) not in (0, "other", False)}
    if knobs:
        _log(f"  scheduling knobs: {knobs}")


_POLICIES = {"batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}


def format_table(result: dict) -> str:
    b = result["burst"]
    lines = [f"burst of {b['clients']} clients: completed {b['completed']}, refused {b['refused']}, "
             f"other {b['other']} in {b['wall_s']} s ({b['requests_s']} req/s)",
             f"  peak open requests {b['peak_open_requests']}; Redis connections at peak: "
             + ", ".join(f"{k} {v}" for k, v in b["redis_connections_peak"].items()),
             f"  gateway: RSS {b['gateway_rss_mib_idle']} -> {b['gateway_rss_mib_peak']} MiB "
             f"({b['gateway_rss_kib_per_open_request']} KiB per open request), CPU peak "
             f"{b['gateway_cpu_percent_peak']} % ({b['gateway_cpu_ms_per_request']} ms per request)",
             f"  TTFT p50/p99 {b['ttft_ms_p50']:.0f}/{b['ttft_ms_p99']:.0f} ms, "
             f"E2E p50/p99 {b['e2e_ms_p50']:.0f}/{b['e2e_ms_p99']:.0f} ms"]
    if b["errors"]:
        lines.append(f"  other: {b['errors']}")
    lat = result.get("latency")
    if lat:
        lines.append(f"added latency per chunk at {lat['peak_open_streams']} open streams ({lat['chunks_compared']} "
                     f"chunks): p50 {lat['added_ms_p50']:.1f} ms, p90 {lat['added_ms_p90']:.1f} ms, "
                     f"p99 {lat['added_ms_p99']:.1f} ms, socket against socket (since the write: gateway p99 "
                     f"{lat['gateway_since_write_ms_p99']:.1f} ms, direct p99 {lat['direct_since_write_ms_p99']:.1f} ms)")
        if "added_by_reads_ms_p99" in lat:
            lines.append(f"  by the readers' read times: p50 {lat['added_by_reads_ms_p50']:.1f} ms, p99 "
                         f"{lat['added_by_reads_ms_p99']:.1f} ms; the load generator read each chunk p50 "
                         f"{lat['client_read_late_ms_p50']:.1f} / p99 {lat['client_read_late_ms_p99']:.1f} ms "
                         "after it reached its socket")
        probe = lat.get("probe")
        if probe and probe["chunks_joined"]:
            tail = probe["slowest_1pct"]
            lines.append("  where it waited (ms, p50 / p99): " + ", ".join(
                f"{part} {probe[part + '_ms']['p50']} / {probe[part + '_ms']['p99']}" for part in frontdoor_probe.PARTS)
                + f"; slowest 1%: mean {tail['mean_ms']}, dominant {tail['dominant_part']}")
            lines.append(f"  loop lag p99 / max: gateway {probe['gateway_loop_lag_ms']['p99']} / "
                         f"{probe['gateway_loop_lag_ms']['max']} ms, client {probe['client_loop_lag_ms']['p99']} / "
                         f"{probe['client_loop_lag_ms']['max']} ms; GC pauses: gateway {probe['gateway_gc_pauses']}, "
                         f"client {probe.get('client_gc_pauses')}")
    lines.append(f"goals: {result['goals']}")
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(f"[bench frontdoor] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("frontdoor", help="the gateway under N concurrent clients: outcomes, Redis connections, "
                                         "memory, CPU, added latency per chunk",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=2000, help="concurrent clients in the burst (half streaming)")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per burst request")
    p.add_argument("--ramp-rate", type=float, default=0.0,
                   help="clients started per second (0: all at once)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="x-pdserve-timeout of every request: how long its client will wait (the gateway's "
                        "default deadline, 600 s, is shorter than a 10,000-request burst takes on a small CPU)")
    p.add_argument("--latency-streams", type=int, default=1000,
                   help="open streams while the added latency per chunk is measured (0: skip that phase)")
    p.add_argument("--latency-requests", type=int, default=0,
                   help="requests in the added-latency phase (0: twice --latency-streams)")
    p.add_argument("--latency-max-tokens", type=int, default=16)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: pdserve up's)")
    p.add_argument("--quantization", default=None, choices=["none", "int8", "gguf"],
                   help="the workers' weights, as `pdserve up --quantization` (default: pdserve up's choice)")
    p.add_argument("--transport", default="ucx", choices=["ucx", "tcp"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for the gateway, e.g. --gateway-arg=--loop=asyncio (repeatable)")
    p.add_argument("--front-first", action="store_true",
                   help="as `pdserve up --front-first` (services/front_first.py): the gateway, router, Redis and "
                        "this process, the clients, on 0.1 ms CPU slices")
    p.add_argument("--no-realtime-gateway", action="store_true",
                   help="as `pdserve up --no-realtime-gateway`: the gateway's event loop in the ordinary class")
    p.add_argument("--worker-nice", type=int, default=0,
                   help="niceness of the prefill and decode workers' threads (0: as started; 10: the gateway, "
                        "router, Redis and clients get a larger share of the cores when they need one)")
    p.add_argument("--front-nice", type=int, default=0,
                   help="niceness of the gateway, router, embedded Redis and the load generator (0: as started; "
                        "below 0 needs root: on a machine shared with other jobs, what the gateway adds when it "
                        "gets a core on time)")
    p.add_argument("--front-realtime", action="store_true",
                   help="run the gateway, router, embedded Redis and the load generator in the real-time class "
                        "(SCHED_RR; root): on a machine other jobs load, the figure without their run-queue waits")
    p.add_argument("--worker-policy", default="other", choices=["other", "batch", "idle"],
                   help="the workers' threads' scheduling policy (SCHED_OTHER, SCHED_BATCH, SCHED_IDLE; lowering "
                        "needs no privilege)")
    p.add_argument("--engine-nice", "--worker-autogroup-nice", type=int, default=None, metavar="N",
                   help="niceness 0-19 of each worker's autogroup, as `pdserve up --engine-nice` (default: pdserve "
                        f"up's, {up_defaults.ENGINE_NICE}; 0: the kernel's default scheduling)")
    p.add_argument("--front-slice-us", type=float, default=0,
                   help="the gateway, router, Redis and load generator ask for slices this long (EEVDF custom "
                        "slice, Linux 6.12+, no privilege; 0: the kernel's default)")
    p.add_argument("--no-probe", action="store_true",
                   help="leave the gateway's per-chunk probe off (fanout_probe.py; on, the latency phase says where "
                        "each chunk waited: the delivery stream, the gateway's loop, the client's)")
    p.add_argument("--client-loop", default="asyncio", choices=event_loop.LOOPS,
                   help="the load generator's event loop (asyncio, as every earlier figure; auto: uvloop when "
                        "installed). It reads every stream in one loop on the same cores as the stack; its "
                        "lateness shows in the added latency by read times, not in the one by socket stamps")
    p.add_argument("--tap", default="delivery", choices=result_tap.SOURCES,
                   help="what the direct reader reads: the gateway's delivery stream, which the same script writes "
                        "with each result stream (one key: the reader stays ready), or every result stream in one "
                        "XREAD (as before the fifteenth session)")
    p.add_argument("--client-gc", default="quiet", choices=["quiet", "default"],
                   help="the load generator's collector in the latency phase: quiet = no full collections "
                        "(which walked every chunk record kept so far) and the burst's objects frozen; default: "
                        "Python's")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
