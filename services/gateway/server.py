"""``pdserve gateway``: the OpenAI-compatible HTTP server and the public gRPC API in one process.

Prints ``[pdserve] gateway ready on HOST:PORT`` once both listen (``pdserve up``
and other tooling parse that prefix). SIGTERM / Ctrl-C stop taking connections,
give open streams ``--drain-timeout`` seconds, then stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from services import event_loop, telemetry
from services.gateway.api_keys import ApiKeys
from services.gateway.config import GatewayConfig
from services.open_files import raise_open_file_limit
from services.registry import connect_redis

log = logging.getLogger(__name__)
READY_PREFIX = "[pdserve] gateway ready on "


def build_config(args) -> GatewayConfig:
    return GatewayConfig(max_body_bytes=args.max_body_bytes, max_queued_requests=args.max_queued_requests,
                         max_queued_tokens=args.max_queued_tokens, retry_after_s=args.retry_after,
                         default_timeout_s=args.default_timeout, max_timeout_s=args.max_timeout,
                         disconnect_grace_s=args.disconnect_grace, deadline_grace_s=args.deadline_grace,
                         sse_heartbeat_s=args.sse_heartbeat,
                         max_model_len=args.max_model_len, max_n=args.max_n, require_ready_worker=not args.allow_no_worker,
                         response_ttl_s=args.response_ttl, coalesce=not args.no_coalesce,
                         redis_max_connections=args.redis_max_connections,
                         redis_pool_timeout_s=args.redis_pool_timeout, lora_admin=args.enable_lora_admin)


async def serve(args) -> None:
    import uvicorn

    from services.gateway.app import served_app
    from services.gateway.core import GatewayCore
    from services.gateway.grpc_api import start_grpc
    from services.gateway.served_model import check_cascade, load_served_model
    from services.realtime_loop import RealtimeLoop

    config = build_config(args)
    raise_open_file_limit()  # a socket per open stream
    keys = ApiKeys.load(args.api_keys, config.tiers, config.default_tier) if args.api_keys \
        else ApiKeys.disabled(config.default_tier)
    telemetry.setup_tracing("pdserve-gateway")
    models = [load_served_model(spec) for spec in (args.model or [None])]
    model = models[0]
    cascade = cascade_spec(args)
    if cascade is not None:  # before Redis: a configuration error is said first
        check_cascade(cascade, {m.name: m for m in models})
    redis = await connect_redis(args.redis_url, max_connections=config.redis_max_connections,
                                pool_timeout_s=config.redis_pool_timeout_s, name="pdserve-gateway")
    core = GatewayCore(redis, config, model, keys, tuple(models[1:]), cascade)
    profiler, admin_server, advert = await _start_admin(redis, args) if args.enable_profiling else (None,) * 3
    server = uvicorn.Server(uvicorn.Config(served_app(core, profiler), host=args.host, port=args.port, lifespan="off",
                                           log_level="warning", access_log=False, backlog=args.backlog,
                                           timeout_graceful_shutdown=args.drain_timeout))
    # uvicorn restores the previous handlers and re-raises the signal after its shutdown: make that
    # "stop" rather than the default action, which would kill the process before the cleanup below.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    grpc_server = None
    try:
        core.start()  # the worker list and the queue depth, read in the background from now on
        grpc_address = "off"
        if args.grpc_port >= 0:
            grpc_server, grpc_port = await start_grpc(core, args.host, args.grpc_port)
            grpc_address = f"{args.host}:{grpc_port}"
        http = asyncio.create_task(server.serve())
        while not server.started:
            if http.done():
                await http  # raises why it could not start
                raise ValueError(f"cannot listen on {args.host}:{args.port}")
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        event_loop.settle_gc(args.gc_thresholds)  # started: later collections walk only what requests make
        realtime = "off"
        if args.realtime:
            refused = RealtimeLoop(asyncio.get_running_loop()).start()
            if refused:
                log.warning("%s", refused)
            realtime = "refused" if refused else "on"
        print(f"{READY_PREFIX}{args.host}:{port} (model {', '.join(core.models)}, grpc {grpc_address}, "
              f"auth {'on' if keys.enabled else 'off'}, real-time loop {realtime})", flush=True)
        await http
    finally:
        if advert is not None:
            await advert.stop()
            await admin_server.stop(grace=None)
        if grpc_server is not None:
            await grpc_server.stop(grace=args.drain_timeout)
        await core.close()
        await redis.aclose()


def cascade_spec(args):
    """``--cascade`` and its options as a CascadeSpec (None without it); ValueError says what is wrong."""
    from services.cascade import CascadeSpec, parse_tiers

    if not args.cascade:
        return None
    return CascadeSpec(parse_tiers(args.cascade), args.cascade_signal, args.cascade_tokens, args.cascade_threshold)


def add_cascade_arguments(p) -> None:
    """``model: "auto"``'s options (services/cascade.py); pdserve up passes them on to its gateway."""
    p.add_argument("--cascade", default=None, metavar="SMALL,LARGE",
                   help='serve model "auto": a cascade over these served models (each given with --model), '
                        "smallest first; a tier whose confidence is under --cascade-threshold passes the request on")
    p.add_argument("--cascade-signal", default="mean", choices=["mean", "min"],
                   help="the confidence: the mean or the minimum log-probability of a tier's first tokens")
    p.add_argument("--cascade-tokens", type=int, default=8,
                   help="how many first tokens a tier is judged on (held back from streaming clients until then)")
    p.add_argument("--cascade-threshold", type=float, default=-1.0,
                   help="escalate when the confidence (a log-probability, <= 0) is under this; 1 always "
                        "escalates, -inf never")


async def _start_admin(redis, args):
    """Profiling on: the Admin service on its own free port (the public gRPC port may be off), advertised
    in Redis so a router's fan-out finds this gateway."""
    from services.advertise import advertised_host, host_port
    from services.profiling.admin import front_profiler, serve_admin
    from services.profiling.peers import AdminAdvert, Peer

    profiler = front_profiler("gateway", redis, True)
    admin_server, port = await serve_admin(profiler, args.host)
    advert = AdminAdvert(redis, Peer("gateway", profiler.process_id, host_port(advertised_host(args.host), port)))
    await advert.start()
    return profiler, admin_server, advert


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    event_loop.run(serve(args), args.loop)
    return 0


def add_parser(sub) -> None:
    d = GatewayConfig()
    p = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (and the public gRPC API)",
                       description="Serve OpenAI-compatible /v1/chat/completions and /v1/completions (streaming, "
                                   "resumable) and the gRPC Generation API over the Redis admission queue.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one)")
    p.add_argument("--grpc-port", type=int, default=50052, help="gRPC port (0: a free one; -1: off)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--model", action="append", default=None,
                   help="a served model (its name and tokenizer); repeat for more, each with its own workers; "
                        "default SmolLM2-135M. LoRA adapters belong to the first")
    add_cascade_arguments(p)
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help='JSON {"sk-...": {"tenant", "tier", "rpm", "tpm"}}; without it auth is off')
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap the context length (default: the decode workers', else the model's)")
    p.add_argument("--max-n", type=int, default=d.max_n,
                   help="most choices one request may ask for (n, completions' best_of); each is a child "
                        "request, so this bounds one request's fan-out; above it is a 400")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="answer 429 while this many requests are unfinished in the queue")
    p.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                   help="answer 429 while the queued requests hold this many prompt tokens")
    p.add_argument("--redis-max-connections", type=int, default=d.redis_max_connections,
                   help="Redis connections this process opens at most, however many requests are open")
    p.add_argument("--redis-pool-timeout", type=float, default=d.redis_pool_timeout_s,
                   help="seconds a request waits for a free Redis connection before 503 + Retry-After")
    p.add_argument("--backlog", type=int, default=4096,
                   help="pending TCP connections the listener queues (a burst of clients connects at once)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413")
    p.add_argument("--retry-after", type=float, default=d.retry_after_s, help="Retry-After of 429/503 for overload")
    p.add_argument("--default-timeout", type=float, default=d.default_timeout_s,
                   help="seconds a request may take when it sends no x-pdserve-timeout")
    p.add_argument("--max-timeout", type=float, default=d.max_timeout_s, help="the largest x-pdserve-timeout")
    p.add_argument("--disconnect-grace", type=float, default=d.disconnect_grace_s,
                   help="seconds a disconnected client has to resume before its request is cancelled")
    p.add_argument("--deadline-grace", type=float, default=d.deadline_grace_s,
                   help="seconds past a request's deadline the gateway waits for the router's deadline error "
                        "before it answers 504 itself (the router stops a generation at its deadline)")
    p.add_argument("--sse-heartbeat", type=float, default=d.sse_heartbeat_s,
                   help="send an SSE comment after this many seconds without an event")
    p.add_argument("--response-ttl", type=int, default=d.response_ttl_s,
                   help="seconds a Responses API response (store: true) is kept for GET /v1/responses/{id} "
                        "and previous_response_id")
    p.add_argument("--no-coalesce", action="store_true",
                   help="compute every request on its own; by default identical requests in flight (same tenant, "
                        "tier, model, prompt tokens and sampling parameters, greedy or with a seed) are computed "
                        "once and each gets the same output under its own id (PDSERVE_NO_COALESCE=1)")
    p.add_argument("--allow-no-worker", action="store_true",
                   help="queue requests even while no decode worker is ready (default: 503)")
    p.add_argument("--loop", default="auto", choices=event_loop.LOOPS,
                   help="the event loop: uvloop (auto: when installed; a fraction of the stdlib loop's CPU per "
                        "callback and socket write, which is most of what thousands of open streams cost) or asyncio")
    p.add_argument("--gc-thresholds", type=event_loop.parse_gc_thresholds, default=event_loop.GATEWAY_GC_THRESHOLDS,
                   metavar="G0,G1,G2",
                   help="the garbage collector's thresholds after startup (gc.set_threshold). Default 700,10,100: "
                        "full collections ten times rarer than Python's 700,10,10, each of which stopped the loop "
                        "every open stream waits on for 80-106 ms at 1,000 streams (BENCHMARKS.md, bench frontdoor)")
    p.add_argument("--realtime", action="store_true",
                   help="run the event loop's thread in the real-time class (SCHED_RR 1; needs CAP_SYS_NICE): it "
                        "never waits for a core behind compute on the same machine, and is ordinary again for 2 s "
                        "whenever it computes 0.5 s without waiting (services/realtime_loop.py). `pdserve up` "
                        "turns it on; refused, it says so once and runs as before")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds open streams get on shutdown")
    p.add_argument("--enable-lora-admin", action="store_true",
                   help="answer POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter "
                        "{lora_name} (vLLM's endpoints): LoRA adapters added and removed at run time, for every "
                        "worker (the path must be readable by each). Off by default: anyone with an API key could "
                        "make the workers read files")
    p.add_argument("--enable-profiling", action="store_true",
                   help="serve POST /admin/profile and Admin.Profile (pdserve profile) on a free gRPC port")
    p.set_defaults(func=run)
