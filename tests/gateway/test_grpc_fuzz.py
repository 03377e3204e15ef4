"""Fuzzing the gateway's public gRPC ``Generation`` API with random and mutated protobuf messages
(tests/proto_fuzz.py): every answer is a documented status, never INTERNAL or UNKNOWN, and the
gateway serves a normal request after each batch. Bounded numbers of examples keep CI fast.
"""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.pdserve.v1 import generate_pb2
from tests.gateway.fake_router import DEFAULT_PIECES
from tests.proto_fuzz import invalid_utf8, messages, mutated, raw_call

KEY = "sk-fuzz-00000001"
AUTH = (("authorization", f"Bearer {KEY}"),)
SERVICE = "/pdserve.v1.Generation/"
METHODS = {"Generate": (generate_pb2.GenerateRequest, True), "Tokenize": (generate_pb2.TokenizeRequest, False),
           "ListModels": (generate_pb2.ListModelsRequest, False)}
# what the API documents (README "gRPC API"): success, bad input, unknown model, overload, auth, deadline
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.FAILED_PRECONDITION}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture
def target(gateway):
    h = gateway(grpc=True, keys={KEY: {"tenant": "fuzz", "tier": "standard"}})
    channel = grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}",
                                    options=[("grpc.max_send_message_length", 64 << 20)])
    yield h, channel
    channel.close()


def _still_serves(channel) -> None:
    chat = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="user", content="Hi")]))
    code, details = raw_call(channel, SERVICE + "Generate", chat.SerializeToString(), True, AUTH)
    assert code == grpc.StatusCode.OK, details


@pytest.mark.parametrize("method", sorted(METHODS))
def test_random_messages_get_documented_answers(target, method):
    h, channel = target
    cls, streaming = METHODS[method]
    seen = collections.Counter()

    @FUZZ
    @given(data=messages(cls.DESCRIPTOR))
    def one(data):
        code, details = raw_call(channel, SERVICE + method, data, streaming, AUTH)
        seen[code] += 1
        assert code in DOCUMENTED, (code, details, data[:200])

    one()
    _still_serves(channel)
    assert sum(seen.values()) > 0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_mutated_and_non_utf8_messages_get_documented_answers(target, method):
    h, channel = target
    cls, streaming = METHODS[method]
    valid = generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="Hi there")]),
        request_id="fuzz-1").SerializeToString() if method == "Generate" else cls().SerializeToString()
    for data in invalid_utf8(cls.DESCRIPTOR):
        code, details = raw_call(channel, SERVICE + method, data, streaming, AUTH)
        assert code in DOCUMENTED, (code, details, data)

    @FUZZ
    @given(data=mutated(valid))
    def one(data):
        code, details = raw_call(channel, SERVICE + method, data, streaming, AUTH)
        assert code in DOCUMENTED, (code, details, data[:200])

    one()
    _still_serves(channel)


def test_without_a_key_every_method_is_unauthenticated(target):
    h, channel = target
    for method, (cls, streaming) in METHODS.items():
        code, _ = raw_call(channel, SERVICE + method, cls().SerializeToString(), streaming)
        assert code == grpc.StatusCode.UNAUTHENTICATED, method
