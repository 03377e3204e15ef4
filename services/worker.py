"""What the prefill and decode services share: the engine, a grpc.aio server with health,
registration in Redis, KV-event publishing, metrics, and graceful drain.

Start-up order (readiness means "model loaded and registered")::

    gRPC server up, health NOT_SERVING   <- liveness answers from here on
    engine loaded (in a thread), role set-up (KV receiver or sender)
    KV "cleared" event, registry entry, heartbeats
    health SERVING                       <- the router may send work

Drain on SIGTERM/SIGINT: health NOT_SERVING and ``draining`` (new work gets
UNAVAILABLE, so the router retries elsewhere), deregister, wait for in-flight
RPCs up to ``drain_timeout_s``, abort what is left (its blocks are freed), stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvtransfer import TransferConfig
from services import event_loop, kv_events, lora_registry, stream_holding, telemetry
from services.advertise import advertised_host, host_port
from services.config import EngineConfig
from services.errors import NoWorkerError, PdserveError
from services.grpc_decode import add_servicer
from services.registry import ROLES, Registrar, WorkerInfo, connect_redis, new_worker_id

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    role: str
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0 picks a free port
    advertise_host: str = ""  # what the registry says (advertise.py); empty: host
    redis_url: str = "redis://127.0.0.1:6379/0"
    metrics_port: int | None = 0  # None: no /metrics server
    heartbeat_s: float = 1.0
    registry_ttl_s: float = 3.0
    kv_events_interval_s: float = 0.02
    stats_interval_s: float = 0.25
    drain_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0  # decode: a reservation waits this long for its KV; prefill: a peer fetch
    stream_interval: int = 1  # decode: a request's tokens go to Redis this many to a chunk (stream_holding.py)
    stream_flush_ms: float = 0.0  # decode: ... or at most once per this many ms (0: per stream_interval)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.registry_ttl_s <= self.heartbeat_s:
            raise ValueError("registry_ttl_s must exceed heartbeat_s")
        for name in ("heartbeat_s", "kv_events_interval_s", "stats_interval_s", "drain_timeout_s",
                     "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        stream_holding.check(self.stream_interval, self.stream_flush_ms)


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, engine_config: EngineConfig, transfer: TransferConfig):
        self.config = config
        self.engine_config = engine_config
        self.transfer = transfer
        self.worker_id = new_worker_id(config.role)
        self.engine = None
        self.aengine = None
        self.redis = None
        self.info: WorkerInfo | None = None
        self.ready = False
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()
        self._stats: dict = {}
        self._tasks: list[asyncio.Task] = []
        self.kv_publisher: kv_events.Publisher | None = None
        self._lora_problems: set[str] = set()
        self._loras_applied: dict[str, str] | None = None  # what the last clean sync applied (None: none yet)
        # idle-cost counters (tests count them: tests/services/test_worker_idle.py)
        self.kv_event_wakeups = 0  # passes of the KV-event loop (each may hop onto the engine thread)
        self.stats_reads = 0  # hops onto the engine thread to read its stats
        self.fetch_bytes_per_s = 0.0  # peer fetches' measured rate (prefill: services/peer_fetch.py), heartbeated
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.metrics_address = ""

    # ---- used by the servicers ------------------------------------------
    @contextlib.asynccontextmanager
    async def admit(self):
        """Count an RPC that takes new work; refused (UNAVAILABLE) unless ready and not draining."""
        if not self.ready or self.draining:
            raise NoWorkerError(f"worker {self.worker_id} is {'draining' if self.draining else 'not ready'}")
        async with self.track():
            yield

    @contextlib.asynccontextmanager
    async def track(self):
        """Count in-flight work that was admitted earlier (a claimed reservation); drain waits for it."""
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    def load(self) -> dict:
        return dict(self._stats, draining=self.draining)

    # ---- lifecycle ------------------------------------------------------
    async def serve(self, add_servicers: Callable[[grpc.aio.Server], list[str]],
                    setup: Callable[[], Awaitable[None]], teardown: Callable[[], Awaitable[None]]) -> None:
        """Run until SIGTERM/SIGINT (or ``stop()``), then drain. ``add_servicers`` returns service names."""
        from services.engine.async_engine import AsyncEngine
        from services.engine.engine import Engine

        cfg = self.config
        telemetry.setup_tracing(f"pdserve-{cfg.role}")
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        names = add_servicers(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for name in ("", *names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        port = self.server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if port == 0:
            raise ValueError(f"cannot listen on {cfg.host}:{cfg.port}")
        advertised = cfg.advertise_host or cfg.host
        self.address = host_port(advertised, port)
        await self.server.start()
        if cfg.metrics_port is not None:
            bound = telemetry.start_metrics_server(cfg.host, cfg.metrics_port)
            self.metrics_address = host_port(advertised, int(bound.rsplit(":", 1)[1]))
        log.info("%s listening on %s (metrics %s); connecting to Redis, then loading the model", self.worker_id, self.address,
                 self.metrics_address or "off")

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop.set)

        registrar = None
        try:
            # before the model: no Redis fails in seconds
            self.redis = await connect_redis(cfg.redis_url, name=f"pdserve-{cfg.role}")
            self.engine = await asyncio.to_thread(Engine, self.engine_config)
            self.aengine = AsyncEngine(self.engine, role=cfg.role)
            if self._stop.is_set():  # stopped while the model loaded: never register
                return
            await setup()
            self._stats = await self.aengine.call(self.engine.stats)
            self.info = WorkerInfo(
                worker_id=self.worker_id, role=cfg.role, address=self.address, model=self.engine.model_name,
                namespace=self.engine.namespace, block_size=self.engine.config.block_size,
                max_model_len=self.engine.max_model_len, metrics_address=self.metrics_address, ready=True,
                kv_block_bytes=self.engine.kv_cache[0].numel() * self.engine.kv_cache.element_size())
            await kv_events.publish_cleared(self.redis, self.worker_id)
            for name, spec in self.engine.loras.known.items():  # --lora: served by the whole deployment
                await lora_registry.add_lora(self.redis, name, spec.path)
            await self._sync_loras()
            registrar = Registrar(self.redis, self.info, self._refresh_info, cfg.heartbeat_s, cfg.registry_ttl_s)
            await registrar.start()
            self._tasks = [asyncio.create_task(self._publish_kv_events(), name="kv-events"),
                           asyncio.create_task(self._poll_stats(), name="stats"),
                           asyncio.create_task(self._follow_loras(), name="loras")]
            self.ready = True
            for name in ("", *names):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("%s ready: %s on %s", self.worker_id, self.engine.model_name, self.address)
            print(f"[pdserve] {cfg.role} worker {self.worker_id} ready on {self.address} "
                  f"(metrics {self.metrics_address or 'off'})", flush=True)
            await self._stop.wait()
            await self._drain(names, registrar)
        finally:
            await self._shutdown(registrar, teardown)

    def stop(self) -> None:
        self._stop.set()

    async def _drain(self, names: list[str], registrar: Registrar) -> None:
        log.info("%s draining (%d in flight)", self.worker_id, self.inflight)
        self.draining = True
        for name in ("", *names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await registrar.stop()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        if self.inflight:
            log.warning("%s: %d requests still in flight after %.0f s; aborting them", self.worker_id,
                        self.inflight, self.config.drain_timeout_s)

    async def _shutdown(self, registrar: Registrar | None, teardown: Callable[[], Awaitable[None]]) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if registrar is not None:
            await registrar.stop()
        if self.server is not None:
            await self.server.stop(grace=1.0)  # cancels what is left; their streams abort their requests
        with contextlib.suppress(Exception):
            await teardown()
        if self.aengine is not None:
            self.aengine.shutdown()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()

    # ---- background -----------------------------------------------------
    def _refresh_info(self, info: WorkerInfo) -> None:
        s = self._stats
        info.draining = self.draining
        info.num_running = int(s.get("num_running", 0))
        info.num_waiting = int(s.get("num_waiting", 0))
        info.queued_prefill_tokens = int(s.get("queued_prefill_tokens", 0))
        info.kv_blocks_total = int(s.get("kv_blocks_total", 0))
        info.kv_blocks_used = int(s.get("kv_blocks_used", 0))
        info.kv_spill_blocks_total = int(s.get("kv_spill_blocks_total", 0))
        info.kv_fetch_bytes_per_s = self.fetch_bytes_per_s
        if self.engine is not None:
            info.loras, info.loaded_loras = self.engine.lora_names(), self.engine.loaded_loras()

    async def _sync_loras(self) -> None:
        """The engine serves exactly the adapters in Redis: new ones registered (config checked; tensors
        read on demand), removed ones forgotten. On the engine thread, which owns the slots."""
        wanted = await lora_registry.read_loras(self.redis)
        if wanted == self._loras_applied:  # the adapters change only here: nothing to do on the engine thread
            return
        engine = self.engine

        def apply() -> list[str]:
            problems = []
            for name in set(engine.lora_names()) - set(wanted):
                engine.unregister_lora(name)
            for name, path in wanted.items():
                spec = engine.loras.known.get(name)
                if spec is not None and spec.path == path:
                    continue
                try:
                    if spec is not None:
                        engine.unregister_lora(name)
                    engine.register_lora(name, path)
                except PdserveError as exc:
                    problems.append(f"{name}: {exc.message}")
            return problems

        problems = set(await self.aengine.call(apply))
        for problem in problems - self._lora_problems:  # each said once
            log.warning("LoRA adapter not served here: %s", problem)
            self._lora_problems.add(problem)
        self._loras_applied = None if problems else wanted  # one that failed to register is tried again

    async def _follow_loras(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                await self._sync_loras()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reading the LoRA adapters failed: %s", exc)

    async def _publish_kv_events(self) -> None:
        """Drain the prefix cache's events and publish them; routers index them within milliseconds.
        The loop sleeps until the engine thread says events wait (AsyncEngine.watch_kv_events), then lets
        ``kv_events_interval_s`` pass so the events of the next steps go in the same publish: an idle worker
        wakes for nothing, a decoding one once per filled block (every block_size tokens) at most. After a
        failed publish, the next one resyncs them (kv_events.Publisher), retried every interval."""
        engine, aengine = self.engine, self.aengine
        publisher = self.kv_publisher = kv_events.Publisher(self.redis, self.worker_id)
        ready = aengine.watch_kv_events()
        while True:
            if not publisher.resync:
                await ready.wait()
            await asyncio.sleep(self.config.kv_events_interval_s)
            self.kv_event_wakeups += 1
            ready.clear()
            aengine.kv_events_taken()  # before the take: events after it wake this loop again
            resync = publisher.resync
            if not resync and not engine.has_kv_events():
                continue
            try:
                events, cached, spilled = await aengine.call(
                    lambda: (engine.take_kv_events(), engine.cached_block_hashes() if resync else None,
                             engine.spilled_block_hashes() if resync else None))
                await publisher.publish(events, cached, spilled)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("publishing KV events failed: %s", exc)

    async def _poll_stats(self) -> None:
        """Keep the engine's stats (heartbeats, /metrics) at most ``stats_interval_s`` old. They change only
        with the engine thread's work (AsyncEngine.activity), so while it did none since the last read there
        is no hop onto it: an idle worker's stats cost nothing."""
        exporter = telemetry.EngineStatsExporter(self.config.role, self.worker_id)
        engine, aengine = self.engine, self.aengine
        seen = -1
        while True:
            if aengine.activity != seen:
                try:
                    self._stats, seen = await aengine.call(lambda: (engine.stats(), aengine.activity))
                    self.stats_reads += 1
                    exporter.update(self._stats)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("reading engine stats failed: %s", exc)
            await asyncio.sleep(self.config.stats_interval_s)


def run_worker(args, role: str, make_servicer, add_to_server, service: str) -> int:
    """``pdserve prefill|decode``: the role's servicer (``make_servicer(runtime)``, with async ``setup`` /
    ``teardown``) on the worker's gRPC server as ``service``, until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime = WorkerRuntime(*configs_from_args(args, role))
    servicer = make_servicer(runtime)

    def add(server: grpc.aio.Server) -> list[str]:
        add_servicer(server, servicer, add_to_server)  # a malformed request is INVALID_ARGUMENT
        add_admin(server, runtime, args.enable_profiling)
        return [service]

    started = time.monotonic()
    event_loop.run(runtime.serve(add, servicer.setup, servicer.teardown), args.loop)
    log.info("%s stopped after %.0f s", runtime.worker_id, time.monotonic() - started)
    return 0


def add_admin(server: grpc.aio.Server, runtime: WorkerRuntime, enabled: bool) -> None:
    """The Admin service (pdserve profile): the torch profiler on the engine thread, plus spans."""
    from proto.pdserve.v1 import admin_pb2_grpc
    from services.profiling.admin import AdminServicer, Profiler
    from services.profiling.recording import EngineProfiler

    async def record(seconds: float, with_stack: bool):
        return await EngineProfiler(runtime.aengine).record(seconds, with_stack)

    add_servicer(server, AdminServicer(Profiler(runtime.config.role, runtime.worker_id, enabled, record)),
                 admin_pb2_grpc.add_AdminServicer_to_server)


def add_worker_parser(sub, role: str, help: str, description: str, run) -> None:
    p = sub.add_parser(role, help=help, description=description)
    add_worker_args(p, role)
    p.set_defaults(func=run)


def add_worker_args(p, role: str) -> None:
    """Flags of `pdserve prefill|decode` (what a container runs)."""
    from services.generate import add_engine_args, add_lora_args

    add_engine_args(p)
    add_lora_args(p)
    p.add_argument("--max-num-seqs", type=int, default=128, help="cap on running sequences")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget of one engine step")
    p.add_argument("--long-prefill-chunk", type=int, default=512, help="largest prefill chunk of one request")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (gRPC and KV transfer)")
    p.add_argument("--advertise-host", default=None,
                   help="address peers reach this worker at (default: --host, or this host's own address when "
                        "--host is 0.0.0.0, as in a container)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one; -1: off)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="registry and KV-event stream")
    p.add_argument("--transport", default="ucx", choices=["ucx", "tcp"], help="KV transfer transport")
    p.add_argument("--allow-transport-fallback", action="store_true",
                   help="use TCP if UCX is unavailable instead of failing")
    p.add_argument("--no-kv-checksum", action="store_true",
                   help="send KV blocks without a checksum per run (a prefill worker's setting; decode workers "
                        "check whatever arrives with one). The check reads each run once on each side, at "
                        "memory speed: off only where that is measured to matter")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--loop", default="auto", choices=event_loop.LOOPS,
                   help="the event loop beside the engine thread: uvloop (auto: when installed; its CPU per step's "
                        "result write and per wake-up is a fraction of the stdlib loop's, and that CPU is taken "
                        "from the engine's cores) or asyncio")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM")
    p.add_argument("--enable-profiling", action="store_true",
                   help="answer Admin.Profile (pdserve profile): record the torch profiler on demand")
    if role == "decode":
        p.add_argument("--transfer-timeout", type=float, default=60.0,
                       help="seconds a reservation waits for its KV before it is freed")
        stream_holding.add_arguments(p)
    else:
        p.add_argument("--transfer-timeout", type=float, default=10.0,
                       help="seconds a peer fetch (a prefix pulled from another prefill worker) may take before "
                            "its blocks are freed and the prefix is computed instead")


def _stream_holding(args) -> dict:
    if not hasattr(args, "stream_flush_ms"):  # not a decode worker
        return {}
    interval, flush_ms = stream_holding.resolve(args.stream_interval, args.stream_flush_ms)
    return {"stream_interval": interval, "stream_flush_ms": flush_ms}


def configs_from_args(args, role: str) -> tuple[WorkerConfig, EngineConfig, TransferConfig]:
    from services.generate import lora_from_args, speculative_from_args, spill_from_args

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, kernels=args.kernels,
        max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None,
        enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, long_prefill_chunk=args.long_prefill_chunk,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        speculative=speculative_from_args(args) if role == "decode" else None, **spill_from_args(args),
        **lora_from_args(args))
    advertise = advertised_host(args.host, args.advertise_host)
    worker = WorkerConfig(role=role, host=args.host, port=args.port, advertise_host=advertise, redis_url=args.redis_url,
                          metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                          drain_timeout_s=args.drain_timeout,
                          transfer_timeout_s=getattr(args, "transfer_timeout", 60.0),
                          **_stream_holding(args))
    transfer = TransferConfig(transport=args.transport, allow_fallback=args.allow_transport_fallback,
                              host=args.host, advertise_host=advertise, checksum=not args.no_kv_checksum)
    return worker, engine, transfer
