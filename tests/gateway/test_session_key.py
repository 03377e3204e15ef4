"""prompt_cache_key / X-Session-ID reach the router in the queue message; a bad key is a 400 naming it."""

from __future__ import annotations

import grpc
import httpx
import pytest

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.queue import QueuedRequest
from services.session_key import MAX_BYTES

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 4}


def test_the_key_travels_from_every_http_api_to_the_router(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert http.post("/v1/chat/completions", json={**CHAT, "prompt_cache_key": "conv-1"}).status_code == 200
        assert http.post("/v1/completions", json={**COMPLETION, "prompt_cache_key": "conv-2"}).status_code == 200
        assert http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4,
                                                "prompt_cache_key": "conv-3"}).status_code == 200
        # clients that cannot set the field send the header; the field wins when both are given
        assert http.post("/v1/completions", json=COMPLETION, headers={"X-Session-ID": "conv-4"}).status_code == 200
        assert http.post("/v1/chat/completions", json={**CHAT, "prompt_cache_key": "conv-5"},
                         headers={"X-Session-ID": "other"}).status_code == 200
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    assert [q.session_key for q in h.router.seen] == ["conv-1", "conv-2", "conv-3", "conv-4", "conv-5", ""]


@pytest.mark.parametrize("body, headers, param", [
    ({"prompt_cache_key": 42}, {}, "prompt_cache_key"),
    ({"prompt_cache_key": ["a"]}, {}, "prompt_cache_key"),
    ({"prompt_cache_key": "k" * (MAX_BYTES + 1)}, {}, "prompt_cache_key"),
    ({"prompt_cache_key": "é" * (MAX_BYTES // 2 + 1)}, {}, "prompt_cache_key"),  # the cap is in UTF-8 bytes
    ({"prompt_cache_key": "line\nbreak"}, {}, "prompt_cache_key"),
    ({}, {"X-Session-ID": "s" * (MAX_BYTES + 1)}, "X-Session-ID"),
])
def test_a_bad_key_is_a_400_naming_it_and_nothing_is_queued(gateway, body, headers, param):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            r = http.post(path, json={**base, **body}, headers=headers)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert http.post("/v1/completions", json={**COMPLETION, "prompt_cache_key": "k" * MAX_BYTES}).status_code == 200
    assert [len(q.session_key) for q in h.router.seen] == [MAX_BYTES]


def test_the_grpc_api_takes_the_field_or_the_metadata(gateway):
    h = gateway(grpc=True)
    with grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        def generate(metadata=(), **kw):
            request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                                                   sampling=common_pb2.SamplingParams(max_tokens=4), **kw)
            return list(stub.Generate(request, metadata=metadata, timeout=10))

        generate(session_key="grpc-1")
        generate(metadata=(("x-session-id", "grpc-2"),))
        with pytest.raises(grpc.RpcError) as info:
            generate(session_key="x" * (MAX_BYTES + 1))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_key" in info.value.details()
    assert [q.session_key for q in h.router.seen] == ["grpc-1", "grpc-2"]


def test_the_queue_message_carries_the_key_and_reads_entries_without_one():
    q = QueuedRequest("r1", "t", "standard", "m", [1, 2], session_key="conv-9")
    assert QueuedRequest.from_fields(q.to_fields()).session_key == "conv-9"
    plain = QueuedRequest("r2", "t", "standard", "m", [1, 2]).to_fields()
    assert "session_key" not in plain and QueuedRequest.from_fields(plain).session_key == ""
    with pytest.raises(ValueError, match="session_key"):
        QueuedRequest.from_fields({**plain, "session_key": "k" * (MAX_BYTES + 1)})
