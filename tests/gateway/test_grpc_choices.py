"""``n`` > 1 and ``best_of`` on the gateway's gRPC Generation API (real gRPC over loopback, the fake router):
every message tagged with its choice index, one usage message with the prompt once, the HTTP path's refusals
as INVALID_ARGUMENT, cancellation and failure of one choice reaching every choice."""

from __future__ import annotations

import grpc
import pytest

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.gateway.fake_router import DEFAULT_PIECES, Plan
from tests.gateway.harness import wait_for

EXPECTED = "".join(DEFAULT_PIECES)


@pytest.fixture
def stub_for(gateway):
    channels = []

    def start(**config):
        h = gateway(grpc=True, **config)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}"))
        return h, generate_pb2_grpc.GenerationStub(channels[-1])

    yield start
    for channel in channels:
        channel.close()


def request(text: str = "Once upon a time", **kw) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text=text, **kw)


def by_choice(replies) -> tuple[dict[int, str], dict[int, common_pb2.Finish]]:
    texts: dict[int, str] = {}
    finishes: dict[int, common_pb2.Finish] = {}
    for r in replies:
        if r.HasField("chunk"):
            texts[r.index] = texts.get(r.index, "") + r.chunk.text
        elif r.HasField("finish"):
            finishes[r.index] = r.finish
    return texts, finishes


def test_streamed_n3_tags_every_message_with_its_choice_and_counts_the_prompt_once(stub_for):
    h, stub = stub_for()
    replies = list(stub.Generate(request(n=3, sampling=common_pb2.SamplingParams(seed=7, temperature=0.8)),
                                 timeout=10))
    texts, finishes = by_choice(replies)
    assert texts == {0: EXPECTED, 1: EXPECTED, 2: EXPECTED}
    assert sorted(finishes) == [0, 1, 2] and all(f.finish_reason == "stop" for f in finishes.values())
    assert sorted(q.sampling["seed"] for q in h.router.seen) == [7, 8, 9]  # choice i: seed + i
    last = replies[-1]
    assert last.WhichOneof("kind") == "usage" and [r.WhichOneof("kind") for r in replies].count("usage") == 1
    assert last.usage.prompt_tokens == len(h.router.seen[0].token_ids)  # once, not three times
    assert last.usage.completion_tokens == 3 * len(DEFAULT_PIECES)
    assert len({r.request_id for r in replies}) == 1


def test_unstreamed_n2_is_one_chunk_and_finish_per_choice_in_index_order(stub_for):
    h, stub = stub_for()
    replies = list(stub.Generate(request(n=2, stream=False, request_id="mine-2"), timeout=10))
    assert [(r.WhichOneof("kind"), r.index) for r in replies] == [
        ("chunk", 0), ("finish", 0), ("chunk", 1), ("finish", 1), ("usage", 0)]
    assert [r.chunk.text for r in replies if r.HasField("chunk")] == [EXPECTED, EXPECTED]
    assert {r.request_id for r in replies} == {"mine-2"}
    assert len(h.router.seen) == 2


def test_best_of_returns_the_n_likeliest_candidates_without_unasked_logprobs(stub_for):
    h, stub = stub_for()
    # the fake router's token i has logprob -0.25 * (i + 1): fewer pieces, likelier candidate
    lengths = {5: 4, 6: 1, 7: 2}
    h.router.plan = lambda req: Plan(pieces=tuple(f"s{req.sampling['seed']}." for _ in range(lengths[req.sampling["seed"]])))
    replies = list(stub.Generate(request(n=2, best_of=3, stream=False, sampling=common_pb2.SamplingParams(seed=5)),
                                 timeout=10))
    texts, finishes = by_choice(replies)
    assert texts == {0: "s6.", 1: "s7.s7."}
    assert all(not r.chunk.logprobs for r in replies if r.HasField("chunk"))  # asked for to rank, not returned
    assert all(q.sampling["logprobs"] == 0 for q in h.router.seen) and len(h.router.seen) == 3
    assert replies[-1].usage.completion_tokens == 4 + 1 + 2  # every candidate, as on HTTP
    kept = list(stub.Generate(request(n=1, best_of=2, stream=False, sampling=common_pb2.SamplingParams(
        seed=6, logprobs=0)), timeout=10))
    assert [len(r.chunk.logprobs) for r in kept if r.HasField("chunk")] == [1]  # asked for: kept


@pytest.mark.parametrize("fields, says", [
    ({"n": 0}, "n must be"),
    ({"n": -2}, "n must be"),
    ({"n": 3}, "--max-n"),  # above this gateway's cap (2)
    ({"n": 2, "best_of": 1, "stream": False}, "best_of must be >= n"),
    ({"best_of": 3, "stream": False}, "--max-n"),
    ({"best_of": 2}, "cannot be streamed"),  # stream defaults to true on gRPC
])
def test_bad_n_or_best_of_is_invalid_argument_before_queueing(stub_for, fields, says):
    h, stub = stub_for(max_n=2)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(**fields), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in info.value.details() and ("best_of" if "best_of" in says or "stream" in says else "n") in \
        info.value.details()
    assert h.router.seen == []


def test_a_cancelled_call_cancels_every_choice(stub_for):
    h, stub = stub_for(disconnect_grace_s=0.2)
    h.router.plan = lambda req: Plan(pieces=("x",) * 200, delay_s=0.02)
    call = stub.Generate(request(n=3, sampling=common_pb2.SamplingParams(seed=1, temperature=1.0)), timeout=10)
    next(call)
    call.cancel()
    assert wait_for(lambda: len(h.router.seen) == 3
                    and sorted(h.router.cancelled) == sorted(q.request_id for q in h.router.seen))
    assert h.router.finished == []


@pytest.mark.parametrize("stream", [True, False])
def test_one_failing_choice_ends_the_call_with_its_status_and_cancels_the_others(stub_for, stream):
    h, stub = stub_for(disconnect_grace_s=0.2)
    h.router.plan = lambda req: (Plan(pieces=("x",) * 3, error_after=1) if req.sampling["seed"] == 2
                                 else Plan(pieces=("x",) * 200, delay_s=0.02))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(n=3, stream=stream, sampling=common_pb2.SamplingParams(seed=1, temperature=1.0)),
                           timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "choice 1" in info.value.details() and "decode worker lost" in info.value.details()
    others = sorted(q.request_id for q in h.router.seen if q.sampling["seed"] != 2)
    assert wait_for(lambda: sorted(h.router.cancelled) == others)
