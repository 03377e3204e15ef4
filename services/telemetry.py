"""The one telemetry setup every pdserve service shares: Prometheus metrics and OpenTelemetry traces.

Metrics live at module level in prometheus_client's default registry, so every part of
a process (servicer, engine poller, router policy) updates the same series and one
``/metrics`` endpoint (``start_metrics_server``) exposes them all. Labels stay bounded:
``role`` is one of ``ROLES``, ``worker`` is a registered worker id, ``outcome`` one of
``OUTCOMES``; never put a request id in a label.

Traces: ``setup_tracing`` installs one SDK TracerProvider per process. A request's trace
crosses processes as W3C trace context (``traceparent``/``tracestate``, plus ``baggage``)::

    router  --gRPC metadata (grpc_metadata)-->  prefill worker (server_span)
    gateway --Redis message field (inject_carrier)-->  dispatcher (context_from_carrier)

Spans are exported over OTLP/gRPC only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the
traces-specific variant) is set; otherwise they are created and dropped, which costs
little and keeps trace ids flowing for logs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from services.profiling import request_traces

ROLES = ("prefill", "decode", "router", "gateway")
OUTCOMES = ("ok", "error", "aborted", "invalid")
ROUTING_REASONS = ("prefix_hit", "load", "round_robin", "local_prefill", "only_worker", "retry")

# ---------------------------------------------------------------- metrics

# 1 ms .. 60 s: a decode step is milliseconds, a long prefill or a queued request tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
BATCH_BUCKETS = tuple(float(2 ** i) for i in range(9))  # 1 .. 256

TTFT_SECONDS = Histogram("pdserve_ttft_seconds", "Time from request arrival to its first output token.",
                         ["role"], buckets=LATENCY_BUCKETS)
INTER_TOKEN_LATENCY_SECONDS = Histogram("pdserve_inter_token_latency_seconds",
                                        "Time between consecutive output tokens of one request.",
                                        ["role"], buckets=LATENCY_BUCKETS)
E2E_LATENCY_SECONDS = Histogram("pdserve_e2e_latency_seconds", "Time from request arrival to its last token.",
                                ["role"], buckets=LATENCY_BUCKETS)
QUEUE_WAIT_SECONDS = Histogram("pdserve_queue_wait_seconds", "Time a request waited before being scheduled.",
                               ["role"], buckets=LATENCY_BUCKETS)
KV_TRANSFER_SECONDS = Histogram("pdserve_kv_transfer_seconds",
                                "From a KV reservation to its last byte arriving (prefill compute overlaps it).",
                                ["role"], buckets=LATENCY_BUCKETS)
BATCH_SIZE = Histogram("pdserve_batch_size", "Requests in one engine step.", ["role"], buckets=BATCH_BUCKETS)

KV_TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes_total", "KV cache bytes sent or received.", ["role"])
REQUESTS = Counter("pdserve_requests_total", "Finished requests by outcome (ok|error|aborted|invalid).",
                   ["role", "outcome"])
ROUTING_DECISIONS = Counter("pdserve_routing_decisions_total", "Worker choices by policy and reason.",
                            ["policy", "role", "worker", "reason"])
RETRIES = Counter("pdserve_retries_total", "Requests re-sent to another worker after a failure.", ["role"])
CASCADE_ESCALATIONS = Counter("pdserve_cascade_escalations_total", "model=auto requests passed from a tier to "
                              "the next (its confidence was under the threshold).", ["from_model", "to_model"])
CASCADE_ANSWERS = Counter("pdserve_cascade_answers_total", "model=auto requests by the tier that answered.", ["model"])
DEAD_LETTERS = Counter("pdserve_dead_letters_total", "Queued requests given up on and dead-lettered.")
QUEUE_DEPTH = Gauge("pdserve_queue_depth", "Requests waiting in the admission queue.", ["tier"])
QUEUE_LAG = Gauge("pdserve_queue_lag", "Queued requests no router has taken yet (the consumer group's lag).",
                  ["tier"])
QUEUE_LAG_SECONDS = Gauge("pdserve_queue_lag_seconds", "Age of the oldest queued request no router has taken yet.",
                          ["tier"])
GENERATION_TOKENS = Counter("pdserve_generation_tokens_total", "Output tokens produced.", ["role", "worker"])
PROMPT_TOKENS = Counter("pdserve_prompt_tokens_total",
                        "Prompt tokens prefilled (computed; prefix-cache hits not counted).", ["role", "worker"])

KV_BLOCKS_USED = Gauge("pdserve_kv_blocks_used", "KV cache blocks in use.", ["role", "worker"])
KV_BLOCKS_TOTAL = Gauge("pdserve_kv_blocks_total", "Usable KV cache blocks.", ["role", "worker"])
NUM_RUNNING = Gauge("pdserve_num_running", "Requests the engine is running.", ["role", "worker"])
NUM_WAITING = Gauge("pdserve_num_waiting", "Requests waiting in the engine scheduler.", ["role", "worker"])
PREFIX_CACHE_QUERIES = Counter("pdserve_prefix_cache_queries_total", "Blocks looked up in the prefix cache.",
                               ["role", "worker"])
PREFIX_CACHE_HITS = Counter("pdserve_prefix_cache_hits_total", "Prefix-cache lookups that hit.",
                            ["role", "worker"])
# The KV cache's tiers (pool, spill: --kv-spill-gb). Blocks per tier and event; bytes and seconds
# of the copies between them (a spill on the engine thread, a restore off it).
KV_TIER_BLOCKS = Gauge("pdserve_kv_tier_blocks", "KV blocks a tier holds at most.", ["role", "worker", "tier"])
KV_TIER_BLOCKS_USED = Gauge("pdserve_kv_tier_blocks_used", "KV blocks a tier holds now (pool: in use).",
                            ["role", "worker", "tier"])
KV_TIER_HITS = Counter("pdserve_kv_tier_hits_total", "Prefix blocks found, by the tier they were found in.",
                       ["role", "worker", "tier"])
KV_SPILLS = Counter("pdserve_kv_spills_total", "KV blocks evicted from the pool into the spill tier.",
                    ["role", "worker"])
KV_SPILL_DROPS = Counter("pdserve_kv_spill_drops_total", "KV blocks the full spill tier let go (their KV is gone).",
                         ["role", "worker"])
KV_RESTORES = Counter("pdserve_kv_restores_total", "KV blocks copied back from the spill tier instead of recomputed.",
                      ["role", "worker"])
KV_TIER_BYTES = Counter("pdserve_kv_tier_bytes_total", "Bytes copied between KV tiers, by direction (spill|restore).",
                        ["role", "worker", "direction"])
KV_TIER_SECONDS = Counter("pdserve_kv_tier_seconds_total",
                          "Seconds of copies between KV tiers, by direction: spill (on the engine thread) | "
                          "restore (off it; from the copy's start until its request is admitted).",
                          ["role", "worker", "direction"])
# Peer fetch (services/peer_fetch.py): a prefill worker pulling a prompt's leading blocks from the
# worker that holds them over kvtransfer. Puller side: fetches by outcome (ok | failed: computed
# instead), the bytes and seconds of the ok ones; holder side: fetches served.
KV_PEER_FETCHES = Counter("pdserve_kv_peer_fetches_total",
                          "Prefix fetches from a peer worker, by outcome (ok | failed: the blocks were computed).",
                          ["role", "worker", "outcome"])
KV_PEER_FETCH_BYTES = Counter("pdserve_kv_peer_fetch_bytes_total", "KV bytes fetched from peer workers.",
                              ["role", "worker"])
KV_PEER_FETCH_SECONDS = Counter("pdserve_kv_peer_fetch_seconds_total",
                                "Seconds of peer fetches, reservation to blocks cached (every outcome).",
                                ["role", "worker"])
KV_PEER_FETCH_SERVED = Counter("pdserve_kv_peer_fetch_served_total",
                               "Prefix fetches this worker sent to a peer, by outcome (ok | refused | failed).",
                               ["role", "worker", "outcome"])
PREEMPTIONS = Counter("pdserve_preemptions_total", "Running requests preempted for lack of KV blocks.",
                      ["role", "worker"])
SPEC_DRAFT_TOKENS = Counter("pdserve_spec_decode_draft_tokens_total",
                            "Speculative decoding: draft tokens verified.", ["role", "worker"])
SPEC_ACCEPTED_TOKENS = Counter("pdserve_spec_decode_accepted_tokens_total",
                               "Speculative decoding: draft tokens the model accepted.", ["role", "worker"])


class EngineStatsExporter:
    """Mirrors one engine's ``stats()`` dict into the gauges and counters above.

    The engine reports cumulative totals; a Prometheus counter only goes up, so each
    update adds the growth since the previous one. A total that went down means the
    engine restarted its counts: the new total is all growth (what Prometheus' own
    counter-reset handling assumes), never a negative increment.
    """

    _GAUGES = (("num_running", NUM_RUNNING), ("num_waiting", NUM_WAITING),
               ("kv_blocks_total", KV_BLOCKS_TOTAL), ("kv_blocks_used", KV_BLOCKS_USED))
    _COUNTERS = (("prefix_cache_queries", PREFIX_CACHE_QUERIES), ("prefix_cache_hits", PREFIX_CACHE_HITS),
                 ("num_preemptions", PREEMPTIONS), ("spec_draft_tokens", SPEC_DRAFT_TOKENS),
                 ("spec_accepted_tokens", SPEC_ACCEPTED_TOKENS))

    # (stats key, counter, extra labels): the tiers' counters, labelled past (role, worker)
    _TIER_COUNTERS = (("prefix_cache_hits", KV_TIER_HITS, ("pool",)),
                      ("kv_spill_hit_blocks", KV_TIER_HITS, ("spill",)),
                      ("kv_spill_blocks", KV_SPILLS, ()), ("kv_spill_dropped_blocks", KV_SPILL_DROPS, ()),
                      ("kv_restored_blocks", KV_RESTORES, ()),
                      ("kv_spill_bytes", KV_TIER_BYTES, ("spill",)), ("kv_restored_bytes", KV_TIER_BYTES, ("restore",)),
                      ("kv_spill_seconds", KV_TIER_SECONDS, ("spill",)),
                      ("kv_restore_seconds", KV_TIER_SECONDS, ("restore",)))

    def __init__(self, role: str, worker_id: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role, self.worker_id = role, worker_id
        self._last = {key: 0.0 for key, _ in self._COUNTERS}
        self._last_tier = {key: 0.0 for key, _, _ in self._TIER_COUNTERS}

    def update(self, stats: Mapping[str, float]) -> None:
        for key, gauge in self._GAUGES:
            gauge.labels(self.role, self.worker_id).set(stats[key])
        for key, counter in self._COUNTERS:
            self._last[key] = self._add(counter.labels(self.role, self.worker_id), stats, key, self._last[key])
        if self.role == "decode":  # its local prefills (n > 1's forked choices count once); prefill workers
            # count theirs per request (prefill/server.py)
            self._last["prompt_tokens_computed"] = self._add(PROMPT_TOKENS.labels(self.role, self.worker_id), stats,
                                                             "prompt_tokens_computed",
                                                             self._last.get("prompt_tokens_computed", 0.0))
        labels = (self.role, self.worker_id)
        KV_TIER_BLOCKS.labels(*labels, "pool").set(stats["kv_blocks_total"])
        KV_TIER_BLOCKS_USED.labels(*labels, "pool").set(stats["kv_blocks_used"])
        if "kv_spill_blocks_total" in stats:  # a spill tier runs
            KV_TIER_BLOCKS.labels(*labels, "spill").set(stats["kv_spill_blocks_total"])
            KV_TIER_BLOCKS_USED.labels(*labels, "spill").set(stats["kv_spill_blocks_used"])
        for key, counter, extra in self._TIER_COUNTERS:
            self._last_tier[key] = self._add(counter.labels(*labels, *extra), stats, key, self._last_tier[key])

    @staticmethod
    def _add(child, stats: Mapping[str, float], key: str, last: float) -> float:
        total = float(stats.get(key, 0))  # absent: a feature this engine does not run
        growth = total - last if total >= last else total
        if growth:
            child.inc(growth)
        return total


def start_metrics_server(host: str = "127.0.0.1", port: int = 0) -> str:
    """Serve ``/metrics`` (the default registry) from a daemon thread; returns the real ``host:port``."""
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_port  # port 0 asked the OS for a free one
    return f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"


# ---------------------------------------------------------------- tracing

# Fixed rather than read from OTEL_PROPAGATORS: the wire format between pdserve processes
# must not depend on each process's environment.
PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])

_lock = threading.Lock()
_provider: TracerProvider | None = None


def build_tracer_provider(service_name: str) -> TracerProvider:
    """A TracerProvider for ``service_name``, exporting over OTLP/gRPC only if an endpoint is configured.

    Not installed globally (``setup_tracing`` does that, once); separate so the
    exporter choice can be checked without the set-once global in the way.
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        # Imported here: pulls in the OTLP protos, which a process without a collector never needs.
        # The exporter reads the endpoint from the environment and connects lazily, in the
        # batch thread, so a missing collector costs dropped spans, never a blocked request.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def setup_tracing(service_name: str) -> TracerProvider:
    """Install this process's TracerProvider and the W3C propagator; later calls return the same provider.

    OTel's global provider can be set only once per process. If something else (an
    embedding application, a test harness) already installed an SDK provider, that one
    is adopted instead of silently losing our spans to a refused second install.
    """
    global _provider
    with _lock:
        if _provider is None:
            existing = trace.get_tracer_provider()
            if isinstance(existing, TracerProvider):
                _provider = existing
            else:
                _provider = build_tracer_provider(service_name)
                trace.set_tracer_provider(_provider)
            propagate.set_global_textmap(PROPAGATOR)
        return _provider


def tracer(name: str) -> trace.Tracer:
    """A tracer from this process's provider (a no-op one until ``setup_tracing`` runs)."""
    return _provider.get_tracer(name) if _provider is not None else trace.get_tracer(name)


def inject_carrier() -> dict[str, str]:
    """The current trace context as a string dict (``traceparent`` etc.), e.g. for a queue message."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return carrier


def context_from_carrier(carrier: Mapping[str, str]) -> otel_context.Context:
    """The context ``inject_carrier`` wrote; pass it as ``context=`` when starting the next span.

    A carrier without (or with a malformed) ``traceparent`` yields a context with no
    parent, so the span starts a new trace rather than failing the request.
    """
    return PROPAGATOR.extract(dict(carrier))


def grpc_metadata(extra: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """``metadata=`` for a grpc.aio client call: ``extra`` plus the current trace context.

    Propagator keys are lowercase ASCII, as gRPC metadata requires.
    """
    return list(extra or []) + list(inject_carrier().items())


@contextlib.contextmanager
def server_span(name: str, context: grpc.aio.ServicerContext, **attributes) -> Iterator[trace.Span]:
    """A SERVER span for one RPC, a child of the caller's span carried in its metadata.

    An exception is recorded on the span, sets ERROR status and is re-raised (an abort()
    raises too, so it counts as an error). Cancellation is a BaseException, not an error:
    the span just ends. The span is the current one inside the block; a streaming handler
    (an async generator) may be closed from another task, whose context cannot reset ours,
    so the context is restored quietly rather than through OTel's detach, which logs that.
    """
    carrier: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):  # "-bin" keys carry bytes; no trace context there
            carrier.setdefault(key, value)
    attrs = {"rpc.system": "grpc", **{k: v for k, v in attributes.items() if v is not None}}
    parent = context_from_carrier(carrier)
    span = tracer("pdserve.grpc").start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attrs)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        with request_traces.bound(attributes.get("request_id") or "", span.get_span_context().trace_id):
            yield span
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()
        try:
            token.var.reset(token)
        except (ValueError, RuntimeError, AttributeError):
            pass  # closed from another context: that context never had our span
