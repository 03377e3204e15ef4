"""The gateway's public gRPC Generation API: the same queue, results, errors and cancellation as HTTP."""

from __future__ import annotations

import grpc
import pytest

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.queue.cancel import cancel_key
from tests.gateway.fake_router import DEFAULT_PIECES, Plan
from tests.gateway.harness import wait_for


@pytest.fixture
def grpc_gateway(gateway):
    h = gateway(grpc=True, keys={"sk-grpc-00000001": {"tenant": "acme", "tier": "standard"}})
    channel = grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}")
    yield h, generate_pb2_grpc.GenerationStub(channel)
    channel.close()


AUTH = (("authorization", "Bearer sk-grpc-00000001"),)


def chat(text: str = "Hi", **kw) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="user", content=text)]), **kw)


def test_generate_streams_chunks_then_finish(grpc_gateway):
    h, stub = grpc_gateway
    replies = list(stub.Generate(chat(sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0), priority=1),
                                 metadata=AUTH, timeout=10))
    chunks = [r.chunk for r in replies if r.HasField("chunk")]
    assert "".join(c.text for c in chunks) == "".join(DEFAULT_PIECES)
    assert [t for c in chunks for t in c.token_ids] == [100 + i for i in range(len(DEFAULT_PIECES))]
    finish = replies[-1].finish
    assert finish.finish_reason == "stop" and finish.usage.completion_tokens == len(DEFAULT_PIECES)
    assert finish.decode_worker == "fake-decode"
    [queued] = h.router.seen
    assert replies[0].request_id == queued.request_id
    assert queued.sampling["max_tokens"] == 8 and queued.sampling["temperature"] == 0
    assert queued.tenant == "acme" and h.router.tiers_seen == ["batch"]  # priority 1: one tier down
    assert 0 < queued.deadline - queued.enqueued_at <= 10.5  # the call's deadline


def test_generate_without_streaming_and_request_id_idempotency(grpc_gateway):
    h, stub = grpc_gateway
    for _ in range(2):
        replies = list(stub.Generate(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                                                                  request_id="mine-1", stream=False),
                                     metadata=AUTH, timeout=10))
        assert [r.WhichOneof("kind") for r in replies] == ["chunk", "finish"]
        assert replies[0].chunk.text == "".join(DEFAULT_PIECES)
        assert {r.request_id for r in replies} == {"mine-1"}
    assert len(h.router.seen) == 1  # the retry attached to the first


def test_errors_map_to_grpc_status(grpc_gateway):
    h, stub = grpc_gateway
    cases = [(chat(), (), grpc.StatusCode.UNAUTHENTICATED),
             (chat(model="nope"), AUTH, grpc.StatusCode.NOT_FOUND),
             (generate_pb2.GenerateRequest(), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
             (chat(sampling=common_pb2.SamplingParams(top_p=3.0)), AUTH, grpc.StatusCode.INVALID_ARGUMENT)]
    for request, metadata, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=metadata, timeout=10))
        assert info.value.code() == code, info.value.details()
    h.router.plan = lambda req: Plan(error_after=1)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(chat(), metadata=AUTH, timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "decode worker lost" in info.value.details()


def test_cancelled_call_cancels_the_request(grpc_gateway, sync_redis):
    h, stub = grpc_gateway
    h.router.plan = lambda req: Plan(pieces=("x",) * 200, delay_s=0.02)
    call = stub.Generate(chat(), metadata=AUTH, timeout=10)
    next(call)
    call.cancel()
    assert wait_for(lambda: len(h.router.cancelled) == 1)
    assert sync_redis.exists(cancel_key(h.router.seen[0].request_id))


def test_tokenize_and_list_models(grpc_gateway):
    h, stub = grpc_gateway
    r = stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello world"), metadata=AUTH, timeout=10)
    assert list(r.token_ids) == h.model.tokenizer.encode("Hello world") and r.max_model_len == 2048
    models = stub.ListModels(generate_pb2.ListModelsRequest(), metadata=AUTH, timeout=10)
    assert [m.id for m in models.models] == [h.model.name]


@pytest.mark.parametrize("structured, says", [
    (common_pb2.StructuredOutput(kind="gbnf", spec='root ::= "a"'), "gbnf"),
    (common_pb2.StructuredOutput(kind="regex", spec="(unclosed"), "regex cannot be compiled"),
    (common_pb2.StructuredOutput(kind="json_schema", spec='{"type": "frob"}'), "frob"),
])
def test_structured_output_the_gateway_cannot_compile_is_invalid_argument(grpc_gateway, sync_redis, structured, says):
    """Refused before queueing, naming the field and the problem."""
    h, stub = grpc_gateway
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(chat(sampling=common_pb2.SamplingParams(structured=structured)), metadata=AUTH, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in info.value.details() and "structured" in info.value.details()
    assert not h.router.seen


def test_structured_output_reaches_the_queue(grpc_gateway):
    h, stub = grpc_gateway
    spec = common_pb2.StructuredOutput(kind="regex", spec="[0-9]+")
    list(stub.Generate(chat(sampling=common_pb2.SamplingParams(max_tokens=4, structured=spec)), metadata=AUTH,
                       timeout=10))
    (queued,) = [r for r in h.router.seen if r.sampling.get("structured")]
    assert queued.sampling["structured"]["kind"] == "regex" and queued.sampling["structured"]["spec"] == "[0-9]+"


@pytest.mark.parametrize("bias, says", [({5: 150.0}, "[-100, 100]"), ({10 ** 8: 1.0}, "outside the vocabulary")])
def test_logit_bias_out_of_range_is_invalid_argument(grpc_gateway, bias, says):
    h, stub = grpc_gateway
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(chat(sampling=common_pb2.SamplingParams(logit_bias=bias)), metadata=AUTH, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in info.value.details() and "logit_bias" in info.value.details()
    assert not h.router.seen


def test_logit_bias_reaches_the_queue(grpc_gateway):
    h, stub = grpc_gateway
    list(stub.Generate(chat(sampling=common_pb2.SamplingParams(max_tokens=4, logit_bias={7: -100.0, 9: 2.5})),
                       metadata=AUTH, timeout=10))
    (queued,) = h.router.seen
    assert queued.sampling["logit_bias"] == {"7": -100.0, "9": 2.5}  # JSON keys; SamplingParams makes them ints
