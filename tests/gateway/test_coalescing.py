"""Request coalescing in the gateway: identical greedy or seeded requests in flight are computed once.

The fake router stands in for the workers: ``router.seen`` is what reached the
queue, so "computed once" is one entry there; the twins' clients each see the
whole output under their own id. The leader is held before its first chunk until
every twin has joined, so the twins overlap however slowly the machine runs.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from services.gateway import metrics
from services.gateway.coalescing import coalescible, coalescing_key
from tests.gateway.fake_router import Plan
from tests.gateway.harness import wait_for
from tests.gateway.sse_client import chat_text, events

PIECES = tuple(f"w{i} " for i in range(8))
GREEDY = {"messages": [{"role": "user", "content": "Count"}], "temperature": 0, "max_tokens": 8}


def coalesced() -> float:
    return sum(metrics.COALESCED_REQUESTS.labels(k)._value.get() for k in ("chat", "completion", "response"))


def held(*harnesses, delay_s: float = 0.0, pieces=PIECES, **plan) -> threading.Event:
    """Hold every request before its first chunk until the returned event is set (from the test's thread)."""
    gates = [asyncio.Event() for _ in harnesses]  # one per harness: each runs its own event loop
    for h, gate in zip(harnesses, gates):
        h.router.plan = lambda req, gate=gate: Plan(pieces=pieces, delay_s=delay_s, hold=gate, **plan)
    release = threading.Event()

    def opener():
        release.wait(30)
        for h, gate in zip(harnesses, gates):
            h.loop.call_soon_threadsafe(gate.set)

    threading.Thread(target=opener, daemon=True).start()
    return release


def in_threads(*calls) -> list:
    out = [None] * len(calls)

    def run(i, call):
        out[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return [out, threads]


def stream(url: str, body: dict, limit: int | None = None) -> tuple[str, list]:
    with httpx.Client(base_url=url, timeout=20) as http:
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, r.read()
            return r.headers["x-request-id"], events(r, limit=limit)


def post(url: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=20) as http:
        return http.post("/v1/chat/completions", json={**body, "stream": False})


def join(started: list, timeout_s: float = 20) -> list:
    out, threads = started
    for t in threads:
        t.join(timeout_s)
    return out


def test_the_key_holds_everything_that_changes_the_output():
    base = {"tenant": "t", "tier": "standard", "model": "m", "token_ids": [1, 2, 3],
            "sampling": {"temperature": 0, "max_tokens": 8, "stop": ["x"]}}
    key = coalescing_key(**base)
    assert coalescing_key(**{**base, "sampling": {"stop": ["x"], "max_tokens": 8, "temperature": 0}}) == key
    assert coalescing_key(**{**base, "sampling": {**base["sampling"], "top_p": 1.0, "top_k": 0}}) == key  # defaults
    assert coalescing_key(**{**base, "sampling": {**base["sampling"], "temperature": 0.0}}) == key  # gRPC's floats
    for change in ({"token_ids": [1, 2, 4]}, {"model": "n"}, {"tenant": "u"}, {"tier": "batch"},
                   {"sampling": {**base["sampling"], "max_tokens": 9}},
                   {"sampling": {**base["sampling"], "stop": ["y"]}},
                   {"sampling": {**base["sampling"], "logprobs": 2}},
                   {"sampling": {**base["sampling"], "skip_special_tokens": False}}):
        assert coalescing_key(**{**base, **change}) != key, change
    assert coalescible({"temperature": 0}) and coalescible({"temperature": 0.9, "seed": 3})
    assert not coalescible({"temperature": 0.9}) and not coalescible({})  # temperature defaults to 1


def test_identical_greedy_requests_are_computed_once_each_under_its_own_id(gateway):
    h = gateway()
    release = held(h)
    before = coalesced()
    started = in_threads(*[lambda: stream(h.url, GREEDY) for _ in range(3)], lambda: post(h.url, GREEDY))
    assert wait_for(lambda: coalesced() - before == 3, 20), "three twins should have joined the first"
    release.set()
    *streams, whole = join(started)
    assert len(h.router.seen) == 1  # one generation reached the queue
    ids = [rid for rid, _ in streams] + [whole.headers["x-request-id"]]
    assert len(set(ids)) == 4
    for rid, evs in streams:
        assert chat_text(evs) == "".join(PIECES) and evs[-1].done
        assert {e.json["id"] for e in evs[:-1]} == {f"chatcmpl-{rid}"}
        assert evs[-2].json["usage"]["completion_tokens"] == len(PIECES)
    body = whole.json()
    assert body["choices"][0]["message"]["content"] == "".join(PIECES)
    assert body["id"] == f"chatcmpl-{whole.headers['x-request-id']}" and body["usage"]["completion_tokens"] == 8
    # once the leader has finished, the same request is computed again (no stale results are served)
    assert post(h.url, GREEDY).json()["choices"][0]["message"]["content"] == "".join(PIECES)
    assert len(h.router.seen) == 2


@pytest.mark.parametrize(("change", "together"), [({"temperature": 0.8}, False),
                                                   ({"temperature": 0.8, "seed": 7}, True),
                                                   ({"max_tokens": 7}, False),
                                                   ({"stop": ["w3"]}, False)])
def test_only_requests_whose_output_is_determined_and_equal_share(gateway, change, together):
    h = gateway()
    release = held(h)
    first = {**GREEDY, **{k: v for k, v in change.items() if k in ("temperature", "seed")}}
    second = {**GREEDY, **change}
    before = coalesced()
    started = in_threads(lambda: post(h.url, first), lambda: post(h.url, second))
    if together:
        assert wait_for(lambda: coalesced() - before == 1, 20)
    else:
        assert wait_for(lambda: len(h.router.seen) == 2, 20)
    release.set()
    answers = join(started)
    assert [a.status_code for a in answers] == [200, 200]
    assert len(h.router.seen) == (1 if together else 2)


def test_coalescing_can_be_turned_off(gateway):
    h = gateway(coalesce=False)
    release = held(h)
    started = in_threads(lambda: post(h.url, GREEDY), lambda: post(h.url, GREEDY))
    assert wait_for(lambda: len(h.router.seen) == 2, 20)
    release.set()
    assert [a.status_code for a in join(started)] == [200, 200]


def test_cancelling_one_of_three_keeps_the_others_streaming(gateway):
    h = gateway(disconnect_grace_s=0.2)
    pieces = tuple(f"t{i} " for i in range(30))
    release = held(h, delay_s=0.03, pieces=pieces)
    before = coalesced()
    leader = in_threads(lambda: stream(h.url, GREEDY, limit=3))  # the client that leaves is the leader's
    assert wait_for(lambda: len(h.router.seen) == 1, 20)
    started = in_threads(lambda: stream(h.url, GREEDY), lambda: stream(h.url, GREEDY))
    assert wait_for(lambda: coalesced() - before == 2, 20)
    release.set()
    (_, cut), = join(leader)
    (_, a), (_, b) = join(started)
    assert len(cut) == 3  # that client left after three events, long before the end
    assert chat_text(a) == chat_text(b) == "".join(pieces)
    assert wait_for(lambda: len(h.router.finished) == 1) and h.router.cancelled == []  # it notes after the final event


def test_the_generation_is_cancelled_when_every_twin_has_left(gateway):
    h = gateway(disconnect_grace_s=0.2)
    release = held(h, delay_s=0.05, pieces=("x ",) * 200)
    before = coalesced()
    started = in_threads(*[lambda: stream(h.url, GREEDY, limit=3) for _ in range(3)])
    assert wait_for(lambda: coalesced() - before == 2, 20)
    release.set()
    join(started)
    assert wait_for(lambda: h.router.cancelled == [h.router.seen[0].request_id], 10)
    assert h.router.finished == []
    # the generation that was cancelled is no one's to join: the next twin is computed afresh
    h.router.plan = lambda req: Plan(pieces=PIECES)
    assert post(h.url, GREEDY).json()["choices"][0]["message"]["content"] == "".join(PIECES)


def test_a_leader_that_fails_fails_its_followers_with_the_same_error(gateway):
    h = gateway()
    release = held(h, error_after=2)
    before = coalesced()
    started = in_threads(lambda: stream(h.url, GREEDY), lambda: stream(h.url, GREEDY), lambda: post(h.url, GREEDY))
    assert wait_for(lambda: coalesced() - before == 2, 20)
    release.set()
    *streams, whole = join(started)
    for _, evs in streams:
        errors = [e.json["error"] for e in evs if not e.done and "error" in e.json]
        assert [e["code"] for e in errors] == ["kv_transfer_error"]
    assert whole.status_code == 502 and whole.json()["error"]["code"] == "kv_transfer_error"


def test_twins_on_two_gateway_replicas_share_one_generation(gateway):
    a, b = gateway(), gateway()
    release = held(a, b)
    before = coalesced()
    started = in_threads(lambda: stream(a.url, GREEDY), lambda: stream(b.url, GREEDY), lambda: post(b.url, GREEDY))
    assert wait_for(lambda: coalesced() - before == 2, 20)
    release.set()
    (_, ea), (rb, eb), whole = join(started)
    assert chat_text(ea) == chat_text(eb) == whole.json()["choices"][0]["message"]["content"] == "".join(PIECES)
    assert len(a.router.seen) + len(b.router.seen) == 1
    # a follower resumes like any request, under its own id
    with httpx.Client(base_url=a.url, timeout=10) as http:
        with http.stream("GET", f"/v1/requests/{rb}/events") as r:
            again = events(r)
    assert chat_text(again) == "".join(PIECES) and {e.json["id"] for e in again[:-1]} == {f"chatcmpl-{rb}"}


def test_grpc_and_http_twins_share_one_generation(gateway):
    """The gRPC API sends every sampling parameter, HTTP only those given: the same values are one key.
    A twin with a much later deadline than the first (HTTP's default 600 s against a 120 s call) runs alone."""
    import grpc

    from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    key = "sk-coalesce-0001"
    h = gateway(grpc=True, keys={key: {"tenant": "acme", "tier": "standard"}})
    release = held(h)
    before = coalesced()
    request = generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="Count")]),
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0))

    def call():
        with grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            replies = list(generate_pb2_grpc.GenerationStub(channel).Generate(
                request, metadata=(("authorization", f"Bearer {key}"),), timeout=120))
        return "".join(r.chunk.text for r in replies if r.HasField("chunk"))

    def http(timeout: str | None):
        headers = {"authorization": f"Bearer {key}", **({"x-pdserve-timeout": timeout} if timeout else {})}
        with httpx.Client(base_url=h.url, timeout=30) as c:
            return c.post("/v1/chat/completions", json=GREEDY, headers=headers)

    leader = in_threads(call)
    assert wait_for(lambda: len(h.router.seen) == 1, 20)
    started = in_threads(call, lambda: http("120"))
    ok = wait_for(lambda: coalesced() - before == 2, 20)
    alone = in_threads(lambda: http(None))
    ok = ok and wait_for(lambda: len(h.router.seen) == 2, 20)
    release.set()
    assert ok, (coalesced() - before, [(q.request_id, q.deadline - q.enqueued_at) for q in h.router.seen])
    (first,) = join(leader)
    second, same_deadline = join(started)
    (later_deadline,) = join(alone)
    assert first == second == "".join(PIECES)
    assert same_deadline.json()["choices"][0]["message"]["content"] == "".join(PIECES)
    assert later_deadline.status_code == 200
