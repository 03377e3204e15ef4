"""services.telemetry against real components: /metrics over HTTP, trace context across a grpc.aio server."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from services import telemetry

# ---------------------------------------------------------------- metrics


@pytest.fixture(scope="module")
def metrics_address():
    return telemetry.start_metrics_server("127.0.0.1", 0)


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics and parse it: {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_server_binds_a_free_port(metrics_address):
    host, port = metrics_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_ttft_observation_is_served_over_http(metrics_address):
    count = ("pdserve_ttft_seconds_count", frozenset({("role", "router")}))
    bucket_5ms = ("pdserve_ttft_seconds_bucket", frozenset({("role", "router"), ("le", "0.005")}))
    bucket_1ms = ("pdserve_ttft_seconds_bucket", frozenset({("role", "router"), ("le", "0.001")}))
    before = scrape(metrics_address)

    telemetry.TTFT_SECONDS.labels(role="router").observe(0.003)

    after = scrape(metrics_address)
    assert after[count] == before.get(count, 0) + 1
    assert after[bucket_5ms] == before.get(bucket_5ms, 0) + 1
    assert after[bucket_1ms] == before.get(bucket_1ms, 0)  # 3 ms is above the 1 ms bucket


def test_engine_stats_counters_grow_by_deltas(metrics_address):
    labels = frozenset({("role", "decode"), ("worker", "w-delta-test")})
    exporter = telemetry.EngineStatsExporter("decode", "w-delta-test")
    stats = {"num_running": 3, "num_waiting": 1, "kv_blocks_total": 100, "kv_blocks_used": 40,
             "prefix_cache_queries": 10, "prefix_cache_hits": 4, "num_preemptions": 1}
    exporter.update(stats)
    exporter.update({**stats, "num_running": 5, "kv_blocks_used": 55, "prefix_cache_queries": 15,
                     "prefix_cache_hits": 6})

    got = scrape(metrics_address)
    assert got[("pdserve_prefix_cache_queries_total", labels)] == 15  # not 10 + 15
    assert got[("pdserve_prefix_cache_hits_total", labels)] == 6
    assert got[("pdserve_preemptions_total", labels)] == 1
    assert got[("pdserve_num_running", labels)] == 5
    assert got[("pdserve_num_waiting", labels)] == 1
    assert got[("pdserve_kv_blocks_used", labels)] == 55
    assert got[("pdserve_kv_blocks_total", labels)] == 100

    # The engine restarted (its totals dropped): the new total is growth, the counter never falls.
    exporter.update({**stats, "prefix_cache_queries": 3, "prefix_cache_hits": 0, "num_preemptions": 0})
    got = scrape(metrics_address)
    assert got[("pdserve_prefix_cache_queries_total", labels)] == 18
    assert got[("pdserve_prefix_cache_hits_total", labels)] == 6


def test_engine_stats_exporter_rejects_unknown_role():
    with pytest.raises(ValueError):
        telemetry.EngineStatsExporter("prefil", "w")


# ---------------------------------------------------------------- tracing


def span_exporters(provider) -> list:
    """The exporters behind a provider's processors (SDK internals: there is no public accessor)."""
    out = []
    for processor in provider._active_span_processor._span_processors:
        inner = getattr(processor, "_batch_processor", processor)
        out.append(getattr(inner, "_exporter", getattr(processor, "span_exporter", None)))
    return out


def test_no_exporter_without_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    provider = telemetry.build_tracer_provider("pdserve-test")
    try:
        assert span_exporters(provider) == []
        assert provider.resource.attributes["service.name"] == "pdserve-test"
    finally:
        provider.shutdown()


def test_otlp_exporter_with_endpoint_and_nothing_listening(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    provider = telemetry.build_tracer_provider("pdserve-test")
    try:
        exporters = span_exporters(provider)
        assert len(exporters) == 1 and isinstance(exporters[0], OTLPSpanExporter)
    finally:
        provider.shutdown()  # nothing queued: returns at once although no collector listens


@pytest.fixture(scope="module")
def spans():
    """setup_tracing's provider with an in-memory exporter attached (the global provider is set once)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        mp.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        provider = telemetry.setup_tracing("pdserve-test")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.clear()


def test_setup_tracing_is_idempotent_and_global(spans):
    provider = telemetry.setup_tracing("pdserve-test")
    assert telemetry.setup_tracing("another-name") is provider
    assert trace.get_tracer_provider() is provider


SERVICE, METHOD = "pdserve.test.Echo", "Call"


async def _call_through_grpc(payload: bytes):
    """One RPC through a real grpc.aio server whose handler opens a server_span; returns (reply, client span)."""

    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        with telemetry.server_span("Echo.Call", context, worker="w-1", unset=None):
            if request == b"boom":
                raise RuntimeError("handler failed")
            return request[::-1]

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(handle)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/{SERVICE}/{METHOD}")
            with telemetry.tracer("test-client").start_as_current_span("client call") as client_span:
                try:
                    reply = await call(payload, metadata=telemetry.grpc_metadata([("x-request-id", "r1")]),
                                       timeout=10)
                except grpc.aio.AioRpcError as exc:
                    reply = exc
        return reply, client_span
    finally:
        await server.stop(None)


def test_trace_context_crosses_a_grpc_call(spans):
    spans.clear()
    reply, client_span = asyncio.run(_call_through_grpc(b"abc"))
    assert reply == b"cba"

    server = [s for s in spans.get_finished_spans() if s.name == "Echo.Call"]
    assert len(server) == 1
    server = server[0]
    client = client_span.get_span_context()
    assert server.kind == SpanKind.SERVER
    assert server.context.trace_id == client.trace_id
    assert server.parent is not None and server.parent.span_id == client.span_id
    assert server.parent.is_remote
    assert server.attributes["worker"] == "w-1" and "unset" not in server.attributes
    assert server.status.status_code != StatusCode.ERROR


def test_server_exception_marks_the_span_as_error(spans):
    spans.clear()
    reply, client_span = asyncio.run(_call_through_grpc(b"boom"))
    assert isinstance(reply, grpc.aio.AioRpcError) and reply.code() == grpc.StatusCode.UNKNOWN

    [server] = [s for s in spans.get_finished_spans() if s.name == "Echo.Call"]
    assert server.status.status_code == StatusCode.ERROR
    assert "handler failed" in server.status.description
    assert any(e.name == "exception" for e in server.events)
    assert server.context.trace_id == client_span.get_span_context().trace_id


def test_grpc_metadata_keeps_extra_and_carries_traceparent(spans):
    with telemetry.tracer("t").start_as_current_span("s") as span:
        md = telemetry.grpc_metadata([("x-request-id", "r1")])
    assert md[0] == ("x-request-id", "r1")
    traceparent = dict(md)["traceparent"]
    assert f"{span.get_span_context().trace_id:032x}" in traceparent


def test_carrier_round_trip_for_a_queue_message(spans):
    spans.clear()
    token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with telemetry.tracer("gateway").start_as_current_span("enqueue") as producer:
            carrier = telemetry.inject_carrier()
    finally:
        otel_context.detach(token)
    assert "traceparent" in carrier and "baggage" in carrier

    ctx = telemetry.context_from_carrier(carrier)  # e.g. the dispatcher, another process
    assert baggage.get_baggage("tenant", ctx) == "acme"
    with telemetry.tracer("dispatcher").start_as_current_span("dequeue", context=ctx) as consumer:
        pass
    assert consumer.get_span_context().trace_id == producer.get_span_context().trace_id
    assert consumer.parent.span_id == producer.get_span_context().span_id

    # No or malformed traceparent: a fresh root span, not an error.
    with telemetry.tracer("dispatcher").start_as_current_span(
            "orphan", context=telemetry.context_from_carrier({"traceparent": "garbage"})) as orphan:
        pass
    assert orphan.parent is None
