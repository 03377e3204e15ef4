"""Against the real stack (pdserve processes on loopback, the real model): every metric the dashboard,
the alert rules and the KEDA triggers read is one the services export, and one request is one trace
across every hop, as the compose observability profile's trace backend would show it.

One stack for the module: one request through the gateway (so labelled series exist), then every
process's /metrics is scraped, and the spans they exported over OTLP are collected by a real OTLP/gRPC
receiver standing in for the collector (the collector and Jaeger images cannot be pulled here)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.launcher import LocalStack, StackSpec
from tests.deploy.deploy_files import Query, all_queries, exposition_names, metric_names

pytestmark = pytest.mark.slow

# Series Prometheus makes itself, per target, rather than reading them from /metrics
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: what the otel-collector receives, kept as (service, span name, trace id)."""

    def __init__(self):
        self.spans: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append((attrs.get("service.name", "?"), span.name, span.trace_id.hex()))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    receiver = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def stack(collector):
    _, endpoint = collector
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)  # every process inherits it, as in compose
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export spans within 0.2 s instead of 5 s
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25,
                     worker_args=["--max-num-batched-tokens", "256"])
    s = LocalStack(spec)
    try:
        s.start(ready_timeout_s=300)
        yield s
    finally:
        s.stop()
        mp.undo()


@pytest.fixture(scope="module")
def served(stack):
    """One streamed chat completion through the gateway (the queue path): the request every series and
    span below comes from."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0, timeout=120)
    # a prompt over one block, so the prefill worker computes and transfers KV (not a local prefill)
    prompt = "Tell me about the history of Paris, the capital of France, in a few sentences. " * 3
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, temperature=0,
                                                 max_tokens=8, messages=[{"role": "user", "content": prompt}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    time.sleep(1.0)  # the workers' stats pollers (0.25 s) and the router's lag monitor (1 s) catch up
    return chunks


@pytest.fixture(scope="module")
def exported(stack, served) -> dict[str, set[str]]:
    """Series names each process serves on /metrics, by process."""
    pages = {name: p.metrics for name, p in stack.procs.items() if p.metrics}
    pages["gateway"] = stack.gateway_address
    assert set(pages) == {"prefill-0", "decode-0", "router", "gateway"}
    names = {}
    for name, address in pages.items():
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            names[name] = exposition_names(resp.read().decode())
    return names


def unknown_metrics(queries: list[Query], exported: set[str]) -> list[str]:
    return [f"{q.source}: {name}" for q in queries for name in sorted(metric_names(q.expr))
            if name not in exported and name not in PROMETHEUS_SERIES]


def test_every_metric_the_deployment_queries_is_exported(exported):
    every = set().union(*exported.values())
    queries = all_queries()
    assert not unknown_metrics(queries, every), "queries name metrics no service exports"
    # ...and the check bites: a panel plotting a metric nobody exports is reported
    typo = Query("pdserve.json: panel 'TTFT'", "histogram_quantile(0.95, rate(pdserve_time_to_first_token_bucket[1m]))")
    assert unknown_metrics([typo], every) == ["pdserve.json: panel 'TTFT': pdserve_time_to_first_token_bucket"]


def test_the_series_the_autoscalers_and_panels_need_carry_samples_after_a_request(stack, served):
    """Declared is not enough for these: each must have a sample once a request was served."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(address: str) -> dict[str, float]:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] += s.value
        return out

    decode = samples(stack.procs["decode-0"].metrics)
    assert decode["pdserve_generation_tokens_total"] >= 1
    assert decode["pdserve_kv_blocks_total"] > 0 and "pdserve_num_running" in decode
    assert decode["pdserve_kv_transfer_bytes_total"] > 0 and decode["pdserve_kv_transfer_seconds_count"] >= 1
    assert samples(stack.procs["prefill-0"].metrics)["pdserve_prompt_tokens_total"] > 0
    router = samples(stack.procs["router"].metrics)
    assert "pdserve_queue_lag" in router and "pdserve_queue_lag_seconds" in router
    gateway = samples(stack.gateway_address)
    assert gateway["pdserve_http_requests_total"] >= 1 and gateway["pdserve_ttft_seconds_count"] >= 1


def test_one_request_is_one_trace_across_every_hop(collector, served):
    receiver, _ = collector
    deadline = time.monotonic() + 30
    while True:
        with receiver.lock:
            spans = list(receiver.spans)
        traces = defaultdict(list)
        for service, name, trace_id in spans:
            traces[trace_id].append((service, name))
        (request_trace,) = [t for t in traces.values() if ("pdserve-gateway", "gateway.generate") in t] or [None]
        services = {s for s, _ in request_trace or []}
        if {"pdserve-gateway", "pdserve-router", "pdserve-prefill", "pdserve-decode"} <= services \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert request_trace is not None, f"no gateway span among {sorted(set(spans))[:20]}"
    assert {"pdserve-gateway", "pdserve-router", "pdserve-prefill", "pdserve-decode"} <= services, request_trace
    assert ("pdserve-decode", "kv_transfer") in request_trace, request_trace
