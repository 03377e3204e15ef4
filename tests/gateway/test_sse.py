"""The SSE stream on the wire: OpenAI's chunk format, ids, headers, errors mid-stream, Nagle off."""

from __future__ import annotations

import socket

import httpx

from tests.gateway.fake_router import DEFAULT_PIECES, Plan
from tests.gateway.sse_client import chat_text, events

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}


def test_chat_stream_format(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions",
                         json={**CHAT, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-cache"
            assert r.headers["x-accel-buffering"] == "no"
            assert r.headers["connection"] == "keep-alive"
            rid = r.headers["x-request-id"]
            evs = events(r)
    assert evs[-1].done and sum(e.done for e in evs) == 1
    body = [e.json for e in evs[:-1]]
    assert all(b["object"] == "chat.completion.chunk" and b["id"] == f"chatcmpl-{rid}" for b in body)
    assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert evs[0].id == "0-0"  # resuming after the opening skips it
    content = body[1:1 + len(DEFAULT_PIECES)]
    assert [c["choices"][0]["delta"] for c in content] == [{"content": p} for p in DEFAULT_PIECES]
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-2])
    assert body[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert body[-1]["choices"] == [] and body[-1]["usage"]["completion_tokens"] == len(DEFAULT_PIECES)
    # every event carries an id: the stream entry's, increasing; the final entry's two events
    # <entry>.0 then <entry>; [DONE] repeats the last one (nothing follows it)
    assert all(e.id for e in evs)
    entries = [e.id for e in evs[1:-3]] + [evs[-2].id]
    assert len(entries) == len(DEFAULT_PIECES) + 1 and evs[-3].id == f"{evs[-2].id}.0" and evs[-1].id == evs[-2].id
    keys = [tuple(int(x) for x in i.split("-")) for i in entries]
    assert keys == sorted(set(keys))


def test_completion_stream_format(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True}) as r:
            evs = events(r)
    body = [e.json for e in evs[:-1]]
    assert all(b["object"] == "text_completion" and "usage" not in b for b in body)
    assert [b["choices"][0]["text"] for b in body[:-1]] == list(DEFAULT_PIECES)
    assert body[-1]["choices"][0]["finish_reason"] == "stop" and body[-1]["choices"][0]["text"] == ""
    assert evs[-1].done


def test_mid_stream_error_is_an_sse_error_event(gateway):
    h = gateway()
    h.router.plan = lambda req: Plan(error_after=2)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            assert r.status_code == 200
            evs = events(r)
        assert chat_text(evs[:-2]) == "".join(DEFAULT_PIECES[:2])
        error = evs[-2]
        assert error.id is not None and evs[-1].done
        assert error.json == {"error": {"message": "decode worker lost", "type": "kv_transfer_error",
                                        "param": None, "code": "kv_transfer_error"}}
        # without streaming, the error event is the response's status
        r = http.post("/v1/chat/completions", json={**CHAT, "stream": False})
        assert r.status_code == 502 and r.json()["error"]["type"] == "kv_transfer_error"


def test_sse_connection_has_nagle_off(gateway):
    h = gateway()
    # slow enough that the stream is surely still open while the socket is inspected
    h.router.plan = lambda req: Plan(delay_s=0.5, pieces=("a",) * 10)
    with httpx.Client(base_url=h.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            # read from one line iterator that stays referenced: ``events(r, ...)`` would drop
            # its own iterator on return, and httpx closes the response with it
            lines = r.iter_lines()
            events(lines, limit=2)
            conns = list(h.server.server_state.connections)
            assert conns
            for conn in conns:
                sock = conn.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
