"""Reading requests' result streams straight from Redis, in a process of its own: the baseline a gateway's
delivery is compared against.

``ResultTap`` starts a child process that follows the result streams of the
request ids it is handed (``follow``), with blocking XREADs over all of them
(one XREAD per hash slot: a gateway's requests share its slot), and notes the
wall time each entry reached it. ``stop`` returns ``{(request id, entry id):
unix time read}`` for the entries written after the tap was told of their
request (an older entry was read late by construction, not by Redis). A process of its own, so that the clients it is compared
with (thousands of SSE streams in the load generator's event loop) neither slow
it down nor are slowed by it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections import defaultdict

_STOP = None


def _tap(redis_url: str, inbox: mp.Queue, outbox: mp.Queue, linger_s: float) -> None:
    import redis

    from services.queue.keys import delivery_tag, result_stream
    from services.queue.results import TERMINAL

    client = redis.Redis.from_url(redis_url, client_name="bench-result-tap")
    cursors: dict[str, str] = {}  # result stream -> last entry id read
    rid_of: dict[str, str] = {}
    since_ms: dict[str, int] = {}  # request id -> when the tap learned of it (entry ids are ms times)
    seen: dict[tuple[str, str], float] = {}
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
            key = result_stream(rid)
            since_ms[rid] = int(time.time() * 1000) + 1
            cursors.setdefault(key, "0-0")
            rid_of[key] = rid
        if stopping_since is not None and (not cursors or time.monotonic() - stopping_since > linger_s):
            break
        if not cursors:
            time.sleep(0.005)
            continue
        by_slot = defaultdict(dict)
        for key, last in cursors.items():
            by_slot[delivery_tag(rid_of[key]) or key][key] = last
        for streams in by_slot.values():
            reply = client.xread(streams, count=1000, block=20)
            now = time.time()
            for key, entries in reply or ():
                key = key.decode() if isinstance(key, bytes) else key
                for entry_id, fields in entries:
                    entry_id = entry_id.decode()
                    if int(entry_id.split("-")[0]) >= since_ms[rid_of[key]]:
                        seen[(rid_of[key], entry_id)] = now
                    cursors[key] = entry_id
                    if fields.get(b"type", b"").decode() in TERMINAL:
                        cursors.pop(key, None)  # finished: stop asking for it
                        break
    client.close()
    outbox.put(seen)


class ResultTap:
    def __init__(self, redis_url: str, linger_s: float = 5.0):
        ctx = mp.get_context("spawn")
        self._in, self._out = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=_tap, args=(redis_url, self._in, self._out, linger_s), daemon=True,
                                 name="result-tap")

    def start(self) -> ResultTap:
        self._proc.start()
        return self

    def follow(self, request_id: str) -> None:
        self._in.put(request_id)

    def stop(self, timeout_s: float = 60.0) -> dict[tuple[str, str], float]:
        """When every followed stream ended (or ``linger_s`` passed): what was read and when."""
        self._in.put(_STOP)
        try:
            seen = self._out.get(timeout=timeout_s)
        finally:
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
        return seen
