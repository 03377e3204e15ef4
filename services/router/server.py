"""``pdserve router``: the router process and its public gRPC Generation API.

Until the gateway serves clients, the router's Generation service is the front
door: it tokenizes (chat template included), validates, and runs each request
through the Dispatcher. It keeps the worker pool (registry) and the global
prefix index (KV-event stream, rebuilt from the start of the stream when the
router starts) up to date in the background. Ready (health SERVING) once the
index has caught up with the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.pdserve.v1 import admin_pb2_grpc, common_pb2, generate_pb2, generate_pb2_grpc
from services import telemetry
from services.advertise import advertised_host, host_port
from services.errors import InvalidRequestError, NoWorkerError
from services.grpc_codec import abort_with, append_chunk, sampling_from_proto
from services.grpc_decode import add_servicer
from services.lora_registry import split_model
from services.profiling.admin import AdminServicer, front_profiler
from services.profiling.peers import AdminAdvert, Peer
from services.registry import connect_redis
from services.router.dispatch import DispatchConfig, Dispatcher
from services.router.policy import POLICY_NAMES, RouterPolicyConfig
from services.router.prefix_index import KVEventFollower, PrefixIndex
from services.router.worker_pool import WorkerPool
from services.session_key import HEADER, session_key_of

log = logging.getLogger(__name__)
SERVICE = "pdserve.v1.Generation"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, dispatcher: Dispatcher, pool: WorkerPool, tokenizer, model_name: str):
        self.dispatcher = dispatcher
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_name = model_name

    def _prompt(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError("give a prompt: text, chat or token_ids", param="input")
        self._adapter(request.model)
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidRequestError("token_ids is empty", param="token_ids")
            return ids
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send token_ids", param="input")
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("text is empty", param="text")
            return self.tokenizer.encode(request.text)
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return self.tokenizer.apply_chat_template(messages)

    def _adapters(self) -> list[str]:
        """The LoRA adapters the workers announce."""
        return sorted({name for w in self.pool.decode_workers() for name in w.loras})

    def _adapter(self, model: str) -> str | None:
        """``model`` -> the LoRA adapter it names (itself or ``<base>:<adapter>``), None for a served model;
        an unknown adapter in the explicit form is INVALID_ARGUMENT, any other unknown name NOT_FOUND."""
        if not model or model == self.model_name or model in self.pool.models():
            return None
        adapter, explicit = split_model(model, self.model_name)
        served = self._adapters()
        if adapter in served:
            return adapter
        if explicit:
            raise InvalidRequestError(f"unknown LoRA adapter {adapter!r}; the workers serve {served or 'none'}",
                                      param="model")
        from services.errors import ModelNotFoundError

        raise ModelNotFoundError(f"model {model!r} is not served here; this deployment serves {self.model_name!r}"
                                 + (f" and the LoRA adapters {served}" if served else ""))

    def _max_model_len(self, model: str = "") -> int:
        workers = self.pool.decode_workers(model)
        return workers[0].max_model_len if workers else 0

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        with telemetry.server_span("generate", context, request_id=rid):
            try:
                prompt = self._prompt(request)
                params = sampling_from_proto(request.sampling)
                for name in ("n", "best_of"):  # one sequence per call here: the gateway fans choices out
                    if request.HasField(name) and getattr(request, name) != 1:
                        raise InvalidRequestError(f"{name} other than 1 is served by the gateway's gRPC API "
                                                  "(pdserve gateway --grpc-port), not the router's", param=name)
                lora = self._adapter(request.model)
                if lora is not None:
                    params.lora = lora
                stream = not request.HasField("stream") or request.stream
                deadline = time.time() + context.time_remaining() if context.time_remaining() else 0.0
                merged = common_pb2.TokenChunk()
                metadata = {k.lower(): v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
                key = session_key_of(request.session_key, metadata.get(HEADER), "session_key")
                pool = request.model if request.model in self.pool.models() else self.model_name
                async for item in self.dispatcher.generate(rid, prompt, params, request.priority, deadline,
                                                           session_key=key, model=pool):
                    if isinstance(item, common_pb2.TokenChunk):
                        if stream:
                            yield generate_pb2.GenerateResponse(chunk=item, request_id=rid)
                        else:
                            append_chunk(merged, item)
                    else:
                        if not stream:
                            yield generate_pb2.GenerateResponse(chunk=merged, request_id=rid)
                        yield generate_pb2.GenerateResponse(finish=item, request_id=rid)
            except Exception as exc:
                await abort_with(context, exc)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context):
        try:
            ids = self._prompt(request)
        except Exception as exc:
            await abort_with(context, exc)
        return generate_pb2.TokenizeResponse(token_ids=ids, max_model_len=self._max_model_len())

    async def ListModels(self, request, context):
        max_len = self._max_model_len()
        others = [m for m in self.pool.models() if m != self.model_name]
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.Model(id=self.model_name, max_model_len=max_len),
                    *(generate_pb2.Model(id=m, max_model_len=self._max_model_len(m)) for m in others),
                    *(generate_pb2.Model(id=n, max_model_len=max_len, parent=self.model_name) for n in self._adapters())])


async def serve(args) -> None:
    telemetry.setup_tracing("pdserve-router")
    tokenizer, model_name = load_tokenizer(args.model)
    policy = RouterPolicyConfig(policy=args.policy, temperature=args.temperature,
                                local_prefill_max_tokens=args.local_prefill_max_tokens,
                                local_prefill_cached=args.local_prefill_cached,
                                prefill_queue_limit_tokens=args.prefill_queue_limit_tokens, seed=args.seed,
                                affinity_load_factor=args.affinity_load_factor,
                                affinity_override_blocks=args.affinity_override_blocks,
                                peer_fetch=args.peer_fetch, peer_fetch_bandwidth_gbps=args.peer_fetch_bandwidth_gbps,
                                peer_fetch_prefill_tokens_per_s=args.peer_fetch_prefill_tokens_per_s)
    redis = await connect_redis(args.redis_url, name="pdserve-router")
    index = PrefixIndex()
    pool = WorkerPool(redis, refresh_s=0.25, on_removed=index.drop_worker)
    follower = KVEventFollower(redis, index)
    dispatcher = Dispatcher(pool, index, DispatchConfig(max_attempts=args.max_attempts,
                                                        transfer_timeout_s=args.transfer_timeout,
                                                        disaggregation=args.disaggregation), policy)
    queue_worker = lag_monitor = None
    if args.queue:
        from services.queue import QueueConfig
        from services.queue.lag import LagMonitor
        from services.router.queue_worker import QueueWorker

        queue_config = QueueConfig(max_deliveries=args.max_deliveries, claim_idle_ms=args.claim_idle_ms)
        queue_worker = QueueWorker(redis, dispatcher, queue_config, max_inflight=args.max_inflight)
        lag_monitor = LagMonitor(redis, queue_config)
    server = grpc.aio.server()
    add_servicer(server, GenerationServicer(dispatcher, pool, tokenizer, model_name),
                 generate_pb2_grpc.add_GenerationServicer_to_server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    admin = front_profiler("router", redis, args.enable_profiling)
    add_servicer(server, AdminServicer(admin), admin_pb2_grpc.add_AdminServicer_to_server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise ValueError(f"cannot listen on {args.host}:{args.port}")
    await server.start()
    advert = AdminAdvert(redis, Peer("router", admin.process_id, host_port(advertised_host(args.host, None), port)))
    metrics = telemetry.start_metrics_server(args.host, args.metrics_port) if args.metrics_port >= 0 else "off"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await pool.start()
        await follower.start()
        await follower.caught_up()
        await advert.start()
        if queue_worker is not None:
            await queue_worker.start()
            lag_monitor.start()
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        print(f"[pdserve] router ready on {args.host}:{port} (policy {args.policy}, metrics {metrics})", flush=True)
        await stop.wait()
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if queue_worker is not None:
            await queue_worker.stop(drain_s=args.drain_timeout)
            queue_worker = None
        await server.stop(grace=args.drain_timeout)
    finally:
        await advert.stop()
        if lag_monitor is not None:
            await lag_monitor.stop()
        if queue_worker is not None:
            await queue_worker.stop()
        await server.stop(grace=None)
        await follower.stop()
        await pool.stop()
        await dispatcher.aclose()
        await redis.aclose()


def load_tokenizer(model: str | None):
    """The served model's name and tokenizer (no weights, no torch: see services/engine/model_source.py)."""
    from services.engine.model_source import model_card
    from services.engine.tokenizer import Tokenizer

    card = model_card(model)
    return (Tokenizer(card.tokenizer_dir) if card.tokenizer_dir else None), card.name


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("router", help="run the router (public gRPC Generation API; routes to workers)",
                       description="Run the KV-aware router: reads the worker registry and KV events from Redis "
                                   "and serves the public gRPC Generation API.")
    p.add_argument("--model", default=None, help="the served model (for its tokenizer); default SmolLM2-135M")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one; -1: off)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--policy", default="kv-aware", choices=POLICY_NAMES)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="softmax temperature for near-ties between workers (0: deterministic)")
    p.add_argument("--seed", type=int, default=None, help="seed of the tie-breaking sampler")
    p.add_argument("--disaggregation", default="auto", choices=["auto", "always", "never"],
                   help="auto: prefill short prompts on the decode worker when cheaper (and when no prefill "
                        "worker is ready)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="auto mode: uncached prompts up to this many tokens prefill on the decode worker (0: off)")
    p.add_argument("--no-local-prefill-cached", dest="local_prefill_cached", action="store_false",
                   help="auto mode: send a prompt whose full blocks the decode worker already holds through a "
                        "prefill worker too (default: the decode worker computes the rest, under a block, itself)")
    p.add_argument("--prefill-queue-limit-tokens", type=int, default=0,
                   help="auto mode: prefill on the decode worker when the prefill queue exceeds this (0: off)")
    p.add_argument("--affinity-load-factor", type=float, default=1.25,
                   help="session affinity (prompt_cache_key, X-Session-ID): a key's worker keeps its sessions "
                        "while it holds under this times the mean requests of its role (>= 1)")
    p.add_argument("--affinity-override-blocks", type=int, default=1,
                   help="session affinity: another worker holding at least this many more leading full blocks "
                        "of the prompt than the key's worker takes the request (>= 1)")
    p.add_argument("--peer-fetch", action="store_true",
                   help="let a prefill worker pull a prompt's prefix from the prefill worker holding it (over the KV "
                        "transport) when the cost model says that beats computing it or queueing at the holder")
    p.add_argument("--peer-fetch-bandwidth-gbps", type=float, default=2.0,
                   help="peer fetch cost model: KV transfer bandwidth between workers, GB/s")
    p.add_argument("--peer-fetch-prefill-tokens-per-s", type=float, default=600.0,
                   help="peer fetch cost model: a prefill worker's prompt tokens per second (CPU default model: ~600)")
    p.add_argument("--max-attempts", type=int, default=3, help="tries per request across workers")
    p.add_argument("--transfer-timeout", type=float, default=60.0)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM")
    p.add_argument("--no-queue", dest="queue", action="store_false",
                   help="do not consume the Redis admission queue (serve gRPC Generate only)")
    p.add_argument("--max-inflight", type=int, default=64, help="queued requests this router runs at once")
    p.add_argument("--claim-idle-ms", type=int, default=30_000,
                   help="reclaim queue entries another router left pending this long")
    p.add_argument("--max-deliveries", type=int, default=3,
                   help="deliveries after which a failing request is dead-lettered")
    p.add_argument("--enable-profiling", action="store_true",
                   help="answer Admin.Profile (pdserve profile): record this router's spans and fan out to "
                        "every worker and gateway")
    p.set_defaults(func=run)


__all__ = ["GenerationServicer", "NoWorkerError", "add_parser", "serve"]
