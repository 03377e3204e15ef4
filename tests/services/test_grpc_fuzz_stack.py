"""Fuzzing the real processes' gRPC APIs: the router's public ``Generation`` API and the workers'
internal ``PrefillWorker`` / ``DecodeWorker`` APIs (which a client inside the cluster network can
reach), with random and mutated protobuf messages (tests/proto_fuzz.py).

Every answer is a documented status, never INTERNAL or UNKNOWN (a crash in a handler) and never a
hang; afterwards every process is still up, a normal request is served, and every worker's KV
blocks are free again (the module's leak check).
"""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from proto.pdserve.v1 import admin_pb2, generate_pb2, worker_pb2
from tests.proto_fuzz import invalid_utf8, messages, mutated, raw_call
from tests.services.stack import Stack

pytestmark = pytest.mark.slow

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE}
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# (process, service, method, request type, server streaming, client streaming)
TARGETS = [
    ("router", "pdserve.v1.Generation", "Generate", generate_pb2.GenerateRequest, True, False),
    ("router", "pdserve.v1.Generation", "Tokenize", generate_pb2.TokenizeRequest, False, False),
    ("decode-0", "pdserve.v1.DecodeWorker", "Reserve", worker_pb2.ReserveRequest, False, False),
    ("decode-0", "pdserve.v1.DecodeWorker", "Decode", worker_pb2.DecodeRequest, True, False),
    ("decode-0", "pdserve.v1.DecodeWorker", "Abort", worker_pb2.AbortRequest, False, False),
    ("prefill-0", "pdserve.v1.PrefillWorker", "Prefill", worker_pb2.PrefillRequest, False, True),
    ("prefill-0", "pdserve.v1.PrefillWorker", "GetLoad", worker_pb2.GetLoadRequest, False, False),
    ("prefill-0", "pdserve.v1.PrefillWorker", "Fetch", worker_pb2.FetchRequest, False, False),
    ("router", "pdserve.v1.Admin", "Profile", admin_pb2.ProfileRequest, False, False),  # profiling off here
    ("decode-0", "pdserve.v1.Admin", "Profile", admin_pb2.ProfileRequest, False, False),
]


@pytest.fixture(scope="module")
def stack(redis_url):
    # short reservations: a fuzzed Reserve that is never followed by a transfer frees its blocks in 3 s
    with Stack(redis_url, prefill=1, decode=1, dtype="bf16",
               worker_args=("--max-model-len", "256"), decode_args=("--transfer-timeout", "3")) as s:
        yield s


def _still_serves(stack) -> None:
    chat = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="user", content="Hi")]))
    with grpc.insecure_channel(stack.address) as channel:
        code, details = raw_call(channel, "/pdserve.v1.Generation/Generate", chat.SerializeToString(), True)
    assert code == grpc.StatusCode.OK, details
    assert all(p.proc.poll() is None for p in stack.procs.values()), "a process died"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}.{t[2]}")
def test_fuzzed_messages_get_documented_answers(stack, target):
    proc, service, method, cls, streaming, client_streaming = target
    path = f"/{service}/{method}"
    seen = collections.Counter()
    with grpc.insecure_channel(stack.procs[proc].address) as channel:
        def call(data: bytes):
            code, details = raw_call(channel, path, data, streaming, timeout=20, client_streaming=client_streaming)
            seen[code.name] += 1
            assert code in DOCUMENTED, (code, details, data[:200])

        for data in invalid_utf8(cls.DESCRIPTOR):
            call(data)
        FUZZ(given(data=messages(cls.DESCRIPTOR))(call))()
        FUZZ(given(data=mutated(cls().SerializeToString() + b"\x0a\x02ok"))(call))()
    assert seen["OK"] + seen["INVALID_ARGUMENT"] > 0
    _still_serves(stack)
