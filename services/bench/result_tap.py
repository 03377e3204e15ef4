"""Reading requests' result streams straight from Redis, in a process of its own: the baseline a gateway's
delivery is compared against.

``ResultTap`` starts a child process that follows the results of the request
ids it is handed (``follow``), with blocking XREADs on their gateways' delivery
streams (by default) or on their own result streams (one XREAD per hash slot: a
gateway's requests share its slot), and notes when
each entry reached it: the kernel's stamp of when the reply's first bytes
reached its socket (socket_time.py), and when the process had read and parsed
it. ``stop`` returns ``{(request id, entry id): (stamped, read)}`` for the
entries written after the tap was told of their request (an older entry was
read late by construction, not by Redis). A process of its own, so that the
clients it is compared with (thousands of SSE streams in the load generator's
event loop) neither slow it down nor are slowed by it. It speaks RESP itself
(hiredis's parser over a plain socket), because a client library's reads
cannot hand out the kernel's stamps.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from collections import defaultdict
from urllib.parse import unquote, urlparse

from services.bench import socket_time

_STOP = None


class _RespSocket:
    """One blocking Redis connection that answers each command with (reply, when its first bytes arrived)."""

    def __init__(self, redis_url: str, name: str):
        import hiredis

        url = urlparse(redis_url)
        if url.scheme not in ("redis", ""):
            raise ValueError(f"the result tap reads Redis over TCP (redis://host:port); got {redis_url!r}")
        self._pack, self._parser = hiredis.pack_command, hiredis.Reader()
        self.sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socket_time.enable(self.sock)
        if url.password:
            self.command("AUTH", *([unquote(url.username)] if url.username else []), unquote(url.password))
        if url.path.strip("/"):
            self.command("SELECT", url.path.strip("/"))
        self.command("CLIENT", "SETNAME", name)

    def command(self, *args) -> tuple[object, float]:
        self.sock.sendall(self._pack(args))
        first = None
        while True:
            reply = self._parser.gets()
            if reply is not False:
                if isinstance(reply, Exception):
                    raise reply
                return reply, first
            data, stamp = socket_time.recv(self.sock)
            if not data:
                raise ConnectionError("Redis closed the result tap's connection")
            first = stamp if first is None else first
            self._parser.feed(data)

    def close(self) -> None:
        self.sock.close()


def _tap(redis_url: str, inbox: mp.Queue, outbox: mp.Queue, linger_s: float, source: str) -> None:
    from services.queue.keys import delivery_tag, inbox_stream, result_stream
    from services.queue.results import TERMINAL

    terminal = {kind.encode() for kind in TERMINAL}
    client = _RespSocket(redis_url, "bench-result-tap")
    cursors: dict[str, str] = {}  # stream read -> last entry id read
    rid_of: dict[str, str] = {}  # result stream -> its request ("streams")
    slot_of: dict[str, str] = {}  # stream read -> its hash slot's tag (one XREAD per slot)
    since_ms: dict[str, int] = {}  # request id -> when the tap learned of it (entry ids are ms times)
    open_rids: set[str] = set()  # followed requests whose final event has not been read
    seen: dict[tuple[str, str], tuple[float, float]] = {}
    stopping_since = None
    while True:
        while True:  # new request ids, without waiting
            try:
                rid = inbox.get_nowait()
            except queue.Empty:
                break
            if rid is _STOP:
                stopping_since = time.monotonic()
                continue
            now_ms = int(time.time() * 1000)
            since_ms[rid] = now_ms + 1
            open_rids.add(rid)
            tag = delivery_tag(rid)
            if source == "delivery" and tag is not None:
                # the entries of this gateway's requests from a second ago on: older ones are the burst's
                cursors.setdefault(inbox_stream(tag), f"{now_ms - 1000}-0")
                slot_of[inbox_stream(tag)] = tag
            else:
                key = result_stream(rid)
                cursors.setdefault(key, "0-0")
                rid_of[key] = rid
                slot_of[key] = tag or key
        if stopping_since is not None and (not open_rids or time.monotonic() - stopping_since > linger_s):
            break
        if not cursors:
            time.sleep(0.005)
            continue
        by_slot = defaultdict(dict)
        for key, last in cursors.items():
            by_slot[slot_of[key]][key] = last
        for streams in by_slot.values():
            reply, stamped = client.command("XREAD", "COUNT", 1000, "BLOCK", 20, "STREAMS", *streams,
                                            *streams.values())
            now = time.time()
            for key, entries in reply or ():
                key = key.decode()
                for entry_id, fields in entries:
                    entry_id = entry_id.decode()
                    cursors[key] = entry_id
                    f = dict(zip(fields[::2], fields[1::2]))
                    if key in rid_of:  # a request's own result stream
                        rid, result_id = rid_of[key], entry_id
                    else:  # a gateway's delivery stream: the request and its result stream's entry id
                        rid, result_id = f.get(b"rid", b"").decode(), f.get(b"id", b"").decode()
                        if rid not in since_ms:
                            continue
                    if int(result_id.split("-")[0]) >= since_ms[rid]:
                        seen[(rid, result_id)] = (stamped, now)
                    if f.get(b"type", b"") in terminal:
                        open_rids.discard(rid)
                        if key in rid_of:
                            cursors.pop(key, None)  # finished: stop asking for it
                            break
    client.close()
    outbox.put(seen)


SOURCES = ("delivery", "streams")


class ResultTap:
    """``source``: what the tap reads. ``streams``: each request's own result stream, all of them in one XREAD.
    ``delivery``: the delivery stream of each request's gateway, which the same Lua script writes with the result
    stream, so an entry becomes readable on both in the same instant (results.py); one key instead of a thousand
    keeps the tap blocked and ready when entries land, where a thousand-key XREAD took the tap's process and Redis
    long enough to answer late the entries written in between, and took their CPU from the processes measured.
    Requests without a gateway tag are read from their result streams either way."""

    def __init__(self, redis_url: str, linger_s: float = 5.0, source: str = "delivery"):
        if source not in SOURCES:
            raise ValueError(f"the result tap reads one of {', '.join(SOURCES)}; got {source!r}")
        ctx = mp.get_context("spawn")
        self._in, self._out = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=_tap, args=(redis_url, self._in, self._out, linger_s, source), daemon=True,
                                 name="result-tap")

    def start(self) -> ResultTap:
        self._proc.start()
        return self

    def follow(self, request_id: str) -> None:
        self._in.put(request_id)

    def stop(self, timeout_s: float = 60.0) -> dict[tuple[str, str], tuple[float, float]]:
        """When every followed stream ended (or ``linger_s`` passed): what was read, when it reached the tap's
        socket (the kernel's stamp) and when the tap had read it."""
        self._in.put(_STOP)
        try:
            seen = self._out.get(timeout=timeout_s)
        finally:
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
        return seen
