"""The gateway's per-request phases (admission, queue wait, first chunk, streaming) in
``pdserve_phase_seconds{role="gateway"}``: one observation each per completed request, on every
path a client can take (streamed and not, HTTP and gRPC), and the queue wait is the router's own
measure from the final event (the fake router reports 0.5 ms)."""

from __future__ import annotations

import grpc
import httpx

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.gateway.test_endpoints import _samples

PHASES = ("admission", "queue_wait", "first_chunk", "streaming")


def _phase(samples: dict, phase: str, what: str = "count") -> float:
    return samples.get((f"pdserve_phase_seconds_{what}", (("phase", phase), ("role", "gateway"))), 0.0)


def test_each_completed_request_records_every_gateway_phase_once(gateway):
    h = gateway(grpc=True)
    body = {"model": h.model.name, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=h.url, timeout=20) as http:
        before = _samples(http)
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        with grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            request = generate_pb2.GenerateRequest(
                chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="Hi")]),
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0))
            replies = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=20))
        assert replies[-1].HasField("finish")
        # refused before admission: no phases for it
        assert http.post("/v1/chat/completions", json={**body, "max_tokens": -1}).status_code == 400
        after = _samples(http)
    for phase in PHASES:
        assert _phase(after, phase) - _phase(before, phase) == 3, phase
    queue_wait = _phase(after, "queue_wait", "sum") - _phase(before, "queue_wait", "sum")
    assert 0 < queue_wait <= 3 * 0.0005 + 1e-9  # the router's queue_ms, capped by what the gateway saw
