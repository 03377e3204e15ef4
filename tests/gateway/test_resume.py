"""Resumable streams (Last-Event-ID), Idempotency-Key, and what a client's disconnect does."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.queue.cancel import cancel_key
from tests.gateway.fake_router import Plan
from tests.gateway.harness import wait_for
from tests.gateway.sse_client import chat_text, events

PIECES = tuple(f"w{i} " for i in range(12))
CHAT = {"messages": [{"role": "user", "content": "Count"}], "stream": True}


def test_resume_after_a_mid_stream_disconnect_has_no_gap_and_no_duplicate(gateway):
    h = gateway(disconnect_grace_s=5.0)
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.05)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            rid = r.headers["x-request-id"]
            first = events(r, limit=4)  # the role chunk and three tokens, then the client drops
        assert chat_text(first) == "".join(PIECES[:3])
        last_id = [e.id for e in first if e.id][-1]
        time.sleep(0.4)  # gone for a while (within the grace period): the request must keep running
        with http.stream("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": last_id}) as r:
            assert r.status_code == 200
            rest = events(r)
        assert rest[-1].done
        assert all(e.json["choices"][0]["delta"].get("role") is None for e in rest[:-1])  # no second opening
        assert chat_text(first) + chat_text(rest) == "".join(PIECES)
        ids = [e.id for e in first + rest if not e.done]
        assert len(ids) == len(set(ids)) == len(PIECES) + 2  # the opening, the tokens, the final
        # the same via the query parameter, and from the final event: only [DONE] is left
        with http.stream("GET", f"/v1/requests/{rid}/events?last_event_id={ids[-1]}") as r:
            assert [e.data for e in events(r)] == ["[DONE]"]
        # from the start: everything again, in the same chunk format and id
        with http.stream("GET", f"/v1/requests/{rid}/events") as r:
            replay = events(r)
        assert chat_text(replay) == "".join(PIECES)
        assert {e.json["id"] for e in replay[:-1]} == {f"chatcmpl-{rid}"}
    assert h.router.cancelled == [] and len(h.router.finished) == 1


def test_resume_of_an_unknown_request_is_404(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        r = http.get("/v1/requests/nope/events")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
        r = http.get("/v1/requests/nope/events", headers={"Last-Event-ID": "garbage"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_idempotency_key_attaches_a_retry_to_the_original_request(gateway):
    h = gateway(disconnect_grace_s=5.0)
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.02)
    key = {"Idempotency-Key": "order-42"}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=CHAT, headers=key) as r:
            rid = r.headers["x-request-id"]
            first = events(r, limit=3)
        last_id = [e.id for e in first if e.id][-1]
        # the retry resumes where the first attempt stopped
        with http.stream("POST", "/v1/chat/completions", json=CHAT, headers={**key, "Last-Event-ID": last_id}) as r:
            assert r.headers["x-request-id"] == rid
            rest = events(r)
        assert chat_text(first) + chat_text(rest) == "".join(PIECES)
        # a non-streaming retry gets the whole answer of the same request
        again = http.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers=key)
        assert again.status_code == 200 and again.headers["x-request-id"] == rid
        assert again.json()["choices"][0]["message"]["content"] == "".join(PIECES)
        # another key is another request
        other = http.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers={"Idempotency-Key": "x"})
        assert other.headers["x-request-id"] != rid
    assert [q.request_id for q in h.router.seen] == [rid, other.headers["x-request-id"]]


def test_concurrent_posts_with_one_idempotency_key_queue_once(gateway):
    h = gateway()
    results = []

    def post():
        with httpx.Client(base_url=h.url, timeout=10) as http:
            results.append(http.post("/v1/completions", json={"prompt": "Hi"}, headers={"Idempotency-Key": "k"}))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 4
    assert len({r.headers["x-request-id"] for r in results}) == 1
    assert len(h.router.seen) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(gateway, sync_redis, stream):
    h = gateway(disconnect_grace_s=0.2)
    h.router.plan = lambda req: Plan(pieces=("x",) * 200, delay_s=0.02)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
                events(r, limit=3)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json={**CHAT, "stream": False}, timeout=0.5)
    assert wait_for(lambda: len(h.router.seen) == 1 and h.router.cancelled == [h.router.seen[0].request_id])
    assert sync_redis.exists(cancel_key(h.router.seen[0].request_id))
    assert h.router.finished == []


def test_a_finished_stream_does_not_cancel(gateway, sync_redis):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            rid = r.headers["x-request-id"]
            assert events(r)[-1].done
    time.sleep(0.3)
    assert not sync_redis.exists(cancel_key(rid))


def test_resuming_after_any_event_gives_exactly_the_events_after_it(gateway):
    """Every event has an id (the opening and the finish chunk before usage too): a client cut off
    right after any of them resumes with nothing repeated and nothing missing."""
    h = gateway(disconnect_grace_s=5.0)
    body = {**CHAT, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            whole = events(r)
        assert all(e.id for e in whole), [e.id for e in whole]
        for i, event in enumerate(whole[:-1]):
            with http.stream("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": event.id}) as r:
                rest = events(r)
            assert [e.data for e in rest] == [e.data for e in whole[i + 1:]], f"after event {i} ({event.id})"


def test_one_key_can_neither_resume_nor_attach_to_another_keys_request(gateway):
    keys = {"sk-tenant-a-0001": {"tenant": "a"}, "sk-tenant-b-0001": {"tenant": "b"}}
    h = gateway(keys=keys, disconnect_grace_s=5.0)
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.02)
    a = {"Authorization": "Bearer sk-tenant-a-0001", "Idempotency-Key": "shared-key"}
    b = {"Authorization": "Bearer sk-tenant-b-0001", "Idempotency-Key": "shared-key"}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        mine = http.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers=a)
        rid = mine.headers["x-request-id"]
        # b's resume of a's request: not found, exactly as for an id that never existed
        r = http.get(f"/v1/requests/{rid}/events", headers={"Authorization": b["Authorization"]})
        missing = http.get("/v1/requests/gw-nope/events", headers={"Authorization": b["Authorization"]})
        assert r.status_code == missing.status_code == 404
        assert r.json()["error"]["type"] == missing.json()["error"]["type"]
        # the same Idempotency-Key under b is b's own request, not a's answer
        theirs = http.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers=b)
        assert theirs.status_code == 200 and theirs.headers["x-request-id"] != rid
        # a still resumes its own
        r = http.get(f"/v1/requests/{rid}/events", headers={"Authorization": a["Authorization"]})
        assert r.status_code == 200
