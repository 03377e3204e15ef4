"""Chunks written by the delivery reader straight to the client's socket (direct_write.py): same bytes, same
order, and a client that reads slowly still gets every chunk in order (those wait in the stream's task)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx

from services.gateway.delivery import Subscription
from tests.gateway.fake_router import Plan
from tests.gateway.sse_client import chat_text, events

CHAT = {"messages": [{"role": "user", "content": "Count"}], "stream": True}
_COUNTER = re.compile(r'^pdserve_gateway_sse_chunks_total\{path="(direct|task)"\} (\S+)$', re.M)


def chunk_counts(http: httpx.Client) -> dict[str, float]:
    return {path: float(v) for path, v in _COUNTER.findall(http.get("/metrics").text)}


def test_a_stream_between_chunks_is_written_by_the_delivery_reader(gateway):
    h = gateway()
    pieces = tuple(f"w{i} " for i in range(12))
    h.router.plan = lambda req: Plan(pieces=pieces, delay_s=0.02)  # the stream's task parks between chunks
    with httpx.Client(base_url=h.url, timeout=10) as http:
        before = chunk_counts(http)
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            evs = events(r)
        after = chunk_counts(http)
    assert chat_text(evs) == "".join(pieces)
    ids = [tuple(int(x) for x in e.id.split(".")[0].split("-")) for e in evs[1:-1]]
    assert ids == sorted(ids) and evs[-1].done
    direct = after.get("direct", 0) - before.get("direct", 0)
    task = after.get("task", 0) - before.get("task", 0)
    assert direct + task == len(pieces)
    assert direct >= len(pieces) // 2, (direct, task)  # most went out from the reader, not the task


def _raw_stream(port: int, body: dict) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's buffer fills
    s.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    return s


def _read_all(s: socket.socket, timeout_s: float = 30.0) -> bytes:
    s.settimeout(timeout_s)
    data = bytearray()
    while not data.endswith(b"0\r\n\r\n"):
        block = s.recv(1 << 20)
        if not block:
            break
        data += block
    return bytes(data)


def test_a_client_that_stops_reading_still_gets_every_chunk_in_order(gateway):
    h = gateway()
    pieces = tuple(f"{i:04d}" + "x" * 65_536 for i in range(128))  # 8 MiB: more than the sockets hold
    h.router.plan = lambda req: Plan(pieces=pieces, delay_s=0.001)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        before = chunk_counts(http)
        s = _raw_stream(int(h.url.rsplit(":", 1)[1]), CHAT)
        try:
            time.sleep(2.0)  # the client reads nothing while the chunks come
            raw = _read_all(s)
        finally:
            s.close()
        after = chunk_counts(http)
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in re.findall(rb"data: \{[^\n]*", raw) for line in [line.decode()])
    assert text == "".join(pieces)  # every chunk, in order, once
    assert after.get("task", 0) - before.get("task", 0) > 0  # the full buffer sent some through the task


def test_the_sink_takes_events_only_while_the_follower_waits_with_nothing_in_hand():
    async def run():
        sub = Subscription("gw-0123456789ab.r", "0")
        taken: list[str] = []
        sub.sink = lambda e: e[1] == "chunk" and not taken.append(e[0])
        sub.push(("1-0", "chunk", {}))  # the follower is not waiting: kept for it
        assert await sub.next(0) == [("1-0", "chunk", {})] and taken == []
        waiting = asyncio.ensure_future(sub.next(5))
        await asyncio.sleep(0)
        sub.push(("2-0", "chunk", {}))  # waiting with nothing in hand: the sink takes it
        assert taken == ["2-0"] and not waiting.done()
        sub.push(("3-0", "final", {}))  # not the sink's: wakes the follower
        sub.push(("4-0", "chunk", {}))  # behind an event in hand: waits its turn, in order
        assert taken == ["2-0"]
        assert [e[0] for e in await waiting] == ["3-0", "4-0"]
        assert sub.sunk == 1
        sub.push(("2-0", "chunk", {}))  # seen already: dropped
        assert await sub.next(0) == []

    asyncio.run(run())


def test_a_sink_that_fails_leaves_the_event_and_the_rest_to_the_follower(caplog):
    async def run():
        sub = Subscription("gw-0123456789ab.r", "0")

        def broken(_event):
            raise RuntimeError("the server's send waited although the connection was ready")

        sub.sink = broken
        waiting = asyncio.ensure_future(sub.next(5))
        await asyncio.sleep(0)
        sub.push(("1-0", "chunk", {}))  # the reader is not hurt: the follower gets the chunk
        assert [e[0] for e in await waiting] == ["1-0"] and sub.sink is None
        waiting = asyncio.ensure_future(sub.next(5))
        await asyncio.sleep(0)
        sub.push(("2-0", "chunk", {}))
        assert [e[0] for e in await waiting] == ["2-0"]

    asyncio.run(run())
    assert "writing gw-0123456789ab.r's chunk from the reader failed" in caplog.text
