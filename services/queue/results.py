"""Per-request result streams: decode workers write token chunks, the gateway reads them back.

Stream ``result_stream(request_id)`` (keys.py); each entry has ``type`` (``chunk`` |
``final`` | ``error``) and ``data`` (JSON). A stream holds any number of
chunks, then exactly one terminal event (``final``: finish reason, usage,
timings; ``error``: ``{"code", "message"}``); readers stop at the first
terminal event, so anything written after one is never seen. Every write
refreshes the stream's TTL, so a stream expires ``ttl_s`` after its last event.

Event data (JSON)::

    chunk  {"token_ids": [int], "text": str,                   written by decode workers,
            "logprobs": [{"token_id", "token", "logprob",      one pipeline per engine step
                          "top": [{"token_id", "token", "logprob"}]}]   (only if requested)}
    final  {"finish_reason": "stop" | "length" | "abort",     written by the router
            "usage": {"prompt_tokens", "completion_tokens", "cached_prompt_tokens"},
            "timings": {"ttft_ms", "e2e_ms", "queue_ms", "prefill_ms"}}
    error  {"code": str, "message": str, "status": int}       OpenAI error type and HTTP status

Entry ids are the SSE ``id:`` the gateway sends: a reader given the last id a
client saw gets exactly the entries after it (XREAD is exclusive of the id),
with no duplicate and no gap.

A request queued by a gateway (its id carries the gateway's tag, keys.py) has
every event also copied to that gateway's delivery stream, in the same Lua
script (one slot, so one atomic step in Redis Cluster too): the gateway reads
the results of all its open requests from that one stream over one connection
(services/gateway/delivery.py) instead of one blocking read per request. The
copy names the request and the entry id the event got in the request's stream::

    pd:res:{<tag>}:inbox   rid, id (the result stream entry id), type, data

The delivery stream is trimmed by its reader as it goes (never by writers, so a
reader that falls behind loses nothing) and expires ``ttl_s`` after the last
write, so a gateway that is gone leaves nothing behind.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from redis.exceptions import NoScriptError

from services.errors import DeadlineExceededError, InvalidRequestError
from services.errors import NotFoundError
from services.queue.keys import delivery_tag, inbox_stream, result_stream
from services.queue.message import text

CHUNK, FINAL, ERROR = "chunk", "final", "error"
TERMINAL = (FINAL, ERROR)
_ENTRY_ID = re.compile(r"\d{1,20}(-\d{1,20})?")

# KEYS: the request's result stream, its gateway's delivery stream
# ARGV: type, data, ttl_s, request_id -> the entry id in the result stream
_DELIVER = """
local id = redis.call('XADD', KEYS[1], '*', 'type', ARGV[1], 'data', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], '*', 'rid', ARGV[4], 'id', id, 'type', ARGV[1], 'data', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return id
"""


def decode_event(fields: dict) -> tuple[str, Any]:
    f = {text(k): v for k, v in fields.items()}
    return text(f.get("type", "")), json.loads(f["data"]) if "data" in f else None


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class ResultWriter:
    def __init__(self, redis, ttl_s: int = 600):
        if ttl_s < 1:
            raise ValueError("ttl_s must be >= 1")
        self.redis = redis
        self.ttl_s = ttl_s
        self._deliver = redis.register_script(_DELIVER)

    def _queue_event(self, pipe, request_id: str, kind: str, data: str) -> int:
        """Queue one event's commands on ``pipe``; returns how many replies they give (the first is the id).
        The script goes as a bare EVALSHA: redis-py's Script object would make every pipeline ask SCRIPT
        EXISTS first, a second round trip per engine step (``_execute`` handles a server without it)."""
        tag = delivery_tag(request_id)
        if tag is None:
            pipe.xadd(result_stream(request_id), {"type": kind, "data": data})
            pipe.expire(result_stream(request_id), self.ttl_s)
            return 2
        pipe.evalsha(self._deliver.sha, 2, result_stream(request_id), inbox_stream(tag),
                     kind, data, self.ttl_s, request_id)
        return 1

    async def _execute(self, events: list[tuple[str, str, str]]) -> list[str]:
        """``(request_id, type, data)`` events in one pipelined round trip; their entry ids. A server that lost
        the script (restarted, flushed) answers NOSCRIPT to each EVALSHA, which wrote nothing: those events go
        again once it is loaded."""
        if not events:
            return []
        ids: list[str] = [""] * len(events)
        pending = list(range(len(events)))
        for attempt in range(2):
            async with self.redis.pipeline(transaction=False) as pipe:
                spans = [(i, self._queue_event(pipe, *events[i])) for i in pending]
                replies = await pipe.execute(raise_on_error=False)
            again, at = [], 0
            for i, n in spans:
                mine, at = replies[at:at + n], at + n
                if attempt == 0 and isinstance(mine[0], NoScriptError):
                    again.append(i)
                    continue
                for reply in mine:
                    if isinstance(reply, Exception):
                        raise reply
                ids[i] = text(mine[0])
            if not again:
                break
            self._deliver.sha = await self.redis.script_load(_DELIVER)
            pending = again
        return ids

    async def append_chunks(self, items: Iterable[tuple[str, dict]]) -> list[str]:
        """One engine step's chunks for many requests, in one pipelined round trip; returns their entry ids."""
        return await self._execute([(request_id, CHUNK, json.dumps(chunk)) for request_id, chunk in items])

    async def finish(self, request_id: str, final: dict) -> str:
        return await self._terminal(request_id, FINAL, final)

    async def error(self, request_id: str, code: str, message: str, status: int = 500) -> str:
        return await self._terminal(request_id, ERROR, {"code": code, "message": message, "status": status})

    async def _terminal(self, request_id: str, kind: str, data: dict) -> str:
        return (await self._execute([(request_id, kind, json.dumps(data))]))[0]


class ResultReader:
    def __init__(self, redis):
        self.redis = redis

    async def last_event(self, request_id: str) -> tuple[str, str, Any] | None:
        """The newest event of a request's stream, or None when the stream does not exist."""
        entries = await self.redis.xrevrange(result_stream(request_id), "+", "-", count=1)
        if not entries:
            return None
        entry_id, fields = entries[0]
        return (text(entry_id), *decode_event(fields))

    async def read(self, request_id: str, last_id: str = "0", block_ms: int = 1000,
                   timeout_s: float | None = 30.0) -> AsyncIterator[tuple[str, str, Any]]:
        """Yield ``(entry_id, type, data)`` after ``last_id``, in order, ending after a final or error event.

        ``timeout_s`` bounds the wait for the next event (None: no bound): when it
        passes, a stream that does not exist raises ``NotFoundError`` (expired, or
        never enqueued) and one that does raises ``DeadlineExceededError``.
        Resuming after the terminal event ends at once with nothing.
        """
        if not isinstance(last_id, str) or not _ENTRY_ID.fullmatch(last_id):
            raise InvalidRequestError(f"not a result event id: {last_id!r}", param="last_id")
        if block_ms < 1:
            raise ValueError("block_ms must be >= 1")
        key = result_stream(request_id)
        if _id_key(last_id) != (0, 0):
            last = await self.last_event(request_id)
            if last is not None and last[1] in TERMINAL and _id_key(last[0]) <= _id_key(last_id):
                return
        waiting_since = time.monotonic()
        while True:
            wait_ms = block_ms
            if timeout_s is not None:
                left_ms = int((waiting_since + timeout_s - time.monotonic()) * 1000)
                if left_ms <= 0:
                    if not await self.redis.exists(key):
                        raise NotFoundError(f"no result stream for request {request_id!r} after {timeout_s:g} s "
                                            f"(it expired, or the request was never queued)")
                    raise DeadlineExceededError(f"no result event for request {request_id!r} in {timeout_s:g} s")
                wait_ms = max(1, min(block_ms, left_ms))
            reply = await self.redis.xread({key: last_id}, count=256, block=wait_ms)
            if not reply:
                continue
            for entry_id, fields in reply[0][1]:
                last_id = text(entry_id)
                kind, data = decode_event(fields)
                yield last_id, kind, data
                if kind in TERMINAL:
                    return
            waiting_since = time.monotonic()
