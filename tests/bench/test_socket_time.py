"""Kernel receive stamps (socket_time.py) and the instruments built on them: a late reader still says when bytes
arrived. ``bench frontdoor``'s added latency per chunk compares these stamps, so that neither the load generator's
lateness nor the direct reader's counts as the gateway's."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid

import redis.asyncio as aioredis

from services.bench import socket_time
from services.bench.http_client import Connection
from services.bench.result_tap import ResultTap
from services.queue.results import ResultWriter

LATE_S = 0.5  # how long each test keeps its reader from reading


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


def _wait_until_stamped(reader: socket.socket, writer: socket.socket) -> None:
    """The kernel turns receive stamps on for the whole host by a deferred work item the first time a socket
    asks: on a busy host the first packets after ``enable`` can arrive unstamped (read by the clock)."""
    deadline = time.monotonic() + 10
    while True:
        writer.sendall(b".")
        _, ancillary, _, _ = reader.recvmsg(16, socket.CMSG_SPACE(16))
        if ancillary or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def test_a_late_read_says_when_the_bytes_reached_the_socket_not_when_they_were_read():
    reader, writer = _tcp_pair()
    with reader, writer:
        assert socket_time.enable(reader)
        _wait_until_stamped(reader, writer)
        sent = time.time()
        writer.sendall(b"chunk")
        time.sleep(LATE_S)
        data, stamp = socket_time.recv(reader)
        read = time.time()
    assert data == b"chunk"
    assert sent - 0.01 <= stamp <= read - LATE_S / 2  # stamped on arrival, not on the late read


def test_an_unstamped_socket_is_timed_by_the_clock_at_the_read():
    reader, writer = _tcp_pair()
    with reader, writer:
        writer.sendall(b"chunk")
        time.sleep(0.05)
        before = time.time()
        data, stamp = socket_time.recv(reader)
    assert data == b"chunk" and stamp >= before


def _sse_server(gap_s: float) -> tuple[int, threading.Thread]:
    """One HTTP/1.1 exchange: a chunked SSE answer with two events ``gap_s`` apart, then the end."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        with server:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each event goes when sent
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for i in (1, 2):
                    event = f"id: {i}-0\ndata: piece {i}\n\n".encode()
                    conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                    time.sleep(gap_s)
                conn.sendall(b"0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


def _read_events(port: int, socket_times: bool) -> list[tuple[str, str, float, float | None]]:
    events = []

    def on_event(event_id, data, read_at, at_socket):
        events.append((event_id, data, read_at, at_socket))
        if len(events) == 1:
            time.sleep(LATE_S)  # the whole loop stops, as a busy load generator's does

    async def run():
        await Connection("127.0.0.1", port, socket_times=socket_times).request("GET", "/", on_event=on_event)

    asyncio.run(run())
    return events


def test_a_stamped_connection_gives_each_event_its_arrival_even_when_its_loop_read_it_late():
    port, server = _sse_server(gap_s=0.05)
    events = _read_events(port, socket_times=True)
    server.join(5)
    assert [(e[0], e[1]) for e in events] == [("1-0", "piece 1"), ("2-0", "piece 2")]
    (_, _, read1, at1), (_, _, read2, at2) = events
    assert at1 <= read1 and at2 <= read2
    # the second event arrived 0.05-0.1 s after the first, while the loop slept in the first's callback
    assert read2 - at2 >= LATE_S / 2
    assert at2 - at1 < LATE_S / 2


def test_an_unstamped_connection_reads_the_same_events_without_stamps():
    port, server = _sse_server(gap_s=0.0)
    events = _read_events(port, socket_times=False)
    server.join(5)
    assert [(e[0], e[1], e[3]) for e in events] == [("1-0", "piece 1", None), ("2-0", "piece 2", None)]


def test_the_result_tap_reads_each_entry_once_whichever_stream_it_follows(redis_url):
    """Through a gateway's delivery stream (the default) or each request's own result stream, the tap sees the
    same entries of the requests it follows, written after it was told of them, each stamped no later than read."""

    async def write(rids: list[str], before: list[str]) -> dict[str, list[str]]:
        r = aioredis.from_url(redis_url)
        writer = ResultWriter(r)
        try:
            await writer.append_chunks([(rid, {"text": "old"}) for rid in before])  # not followed
            await asyncio.sleep(0.2)  # the tap has been told of ``rids``
            ids = {rid: [] for rid in rids}
            for step in range(3):
                for rid, entry_id in zip(rids, await writer.append_chunks([(rid, {"text": str(step)})
                                                                            for rid in rids])):
                    ids[rid].append(entry_id)
            for rid in rids:
                ids[rid].append(await writer.finish(rid, {"finish_reason": "stop"}))
            return ids
        finally:
            await r.aclose()

    for source in ("delivery", "streams"):
        tag = f"gw-{uuid.uuid4().hex[:12]}"
        rids = [f"{tag}.{uuid.uuid4().hex}" for _ in range(3)]
        other = f"{tag}.{uuid.uuid4().hex}"
        tap = ResultTap(redis_url, linger_s=5.0, source=source).start()
        try:
            time.sleep(1.0)  # the tap's process is up
            for rid in rids:
                tap.follow(rid)
            written = asyncio.run(write(rids, before=[other]))
        finally:
            seen = tap.stop(timeout_s=30)
        expected = {(rid, entry_id) for rid, ids in written.items() for entry_id in ids}
        assert set(seen) == expected, source
        assert all(stamp <= read for stamp, read in seen.values()), source
