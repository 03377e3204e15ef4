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

A chunk written with its attempt's worker request id (``<id>.<attempt>``,
router/dispatch.py) is fenced: before the router retries a request it names the
new attempt in ``fence_key(request_id)`` and only then reads what the stream
holds; a chunk of an earlier attempt that reaches Redis after that (its decode
worker had the write in flight when the attempt failed) is dropped in the same
script that would have appended it. So what the retry resumes from is exactly
what the client can ever see: no token twice, none missing.

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
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from services.errors import DeadlineExceededError, InvalidRequestError
from services.errors import NotFoundError
from services.queue.keys import delivery_tag, fence_key, inbox_stream, result_stream
from services.queue.message import text

CHUNK, FINAL, ERROR = "chunk", "final", "error"
TERMINAL = (FINAL, ERROR)
_ENTRY_ID = re.compile(r"\d{1,20}(-\d{1,20})?")

# An attempt's chunk is dropped (nil) once the fence names another attempt.
_FENCED = """
if ARGV[4] ~= '' then
  local current = redis.call('GET', KEYS[2])
  if current and current ~= ARGV[4] then return false end
end
"""
# KEYS: the request's result stream, its fence key
# ARGV: type, data, ttl_s, attempt ('' for unfenced) -> the entry id, or nil when fenced off
_APPEND = _FENCED + """
local id = redis.call('XADD', KEYS[1], '*', 'type', ARGV[1], 'data', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return id
"""
# KEYS: as _APPEND, then its gateway's delivery stream; ARGV: as _APPEND, then the request id
_DELIVER = _APPEND.replace("return id", """
redis.call('XADD', KEYS[3], '*', 'rid', ARGV[5], 'id', id, 'type', ARGV[1], 'data', ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return id""")


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
        self._append = redis.register_script(_APPEND)
        self._deliver = redis.register_script(_DELIVER)

    async def _queue_event(self, pipe, request_id: str, kind: str, data: str, attempt: str = "") -> None:
        """Queue one event's script on ``pipe``; its reply is the entry id (nil when fenced off)."""
        keys, args = [result_stream(request_id), fence_key(request_id)], [kind, data, self.ttl_s, attempt]
        tag = delivery_tag(request_id)
        if tag is None:
            await self._append(keys=keys, args=args, client=pipe)
        else:
            await self._deliver(keys=[*keys, inbox_stream(tag)], args=[*args, request_id], client=pipe)

    async def append_chunks(self, items: Iterable[tuple[str, dict]],
                            attempts: Sequence[str] | None = None) -> list[str | None]:
        """One engine step's chunks for many requests, in one pipelined round trip; returns their entry ids.

        ``attempts``: each chunk's worker request id, so a fenced-off attempt's chunk is
        dropped (its id None); without it the chunks are not fenced.
        """
        items = list(items)
        if not items:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for i, (request_id, chunk) in enumerate(items):
                await self._queue_event(pipe, request_id, CHUNK, json.dumps(chunk), attempts[i] if attempts else "")
            replies = await pipe.execute()
        return [None if r is None else text(r) for r in replies]

    async def fence(self, request_id: str, attempt: str) -> None:
        """From now on only ``attempt`` may add chunks to the request's stream (call before reading it to retry)."""
        await self.redis.set(fence_key(request_id), attempt, ex=self.ttl_s)

    async def finish(self, request_id: str, final: dict) -> str:
        return await self._terminal(request_id, FINAL, final)

    async def error(self, request_id: str, code: str, message: str, status: int = 500) -> str:
        return await self._terminal(request_id, ERROR, {"code": code, "message": message, "status": status})

    async def _terminal(self, request_id: str, kind: str, data: dict) -> str:
        async with self.redis.pipeline(transaction=False) as pipe:
            await self._queue_event(pipe, request_id, kind, json.dumps(data))
            replies = await pipe.execute()
        return text(replies[0])


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
