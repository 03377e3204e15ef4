"""What a resumed stream needs to look like the original: one small Redis hash per request.

``pd:gw:req:<request_id>`` is written before the request is queued (so whoever
finds the request id, through an Idempotency-Key or the events endpoint, finds
its record) and expires after ``ttl_s``. ``readers`` counts the clients attached
to the request's result stream right now, on every gateway replica: a request is
cancelled only when its last reader left and nobody re-attached within the grace
period (core.py). A coalesced follower (coalescing.py) has a record of its own
that names the leader as its ``source``; its readers are counted on the
leader's record, beside the leader's own, since they share one generation.
An ``n`` > 1 request has one record per choice (``choice_records``), each for the
result stream of its choice (services/queue/message.py ``choice_id``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.queue.message import choice_id, text_fields

CHAT, COMPLETION = "chat", "completion"


def record_key(request_id: str) -> str:
    return f"pd:gw:req:{request_id}"


@dataclass
class RequestRecord:
    request_id: str
    kind: str  # chat | completion: which OpenAI object its chunks are
    model: str
    created: int  # unix seconds, the response's "created"
    tenant: str
    include_usage: bool = False
    logprobs: int | None = None  # top-n alternatives per token; None: no logprobs
    deadline: float = 0.0  # unix seconds; 0 = none
    prompt_tokens: int = 0
    source: str = ""  # a coalesced follower: the leader whose generation and result stream it shares
    coalesce: str = ""  # the coalescing key its generation holds (coalescing.py); "" when not coalescible
    tools: str = ""  # tools.ToolChoice as JSON when the output may hold tool calls; "" otherwise

    @property
    def stream_id(self) -> str:
        """The request id whose result stream, reader count and cancellation this request's are."""
        return self.source or self.request_id

    def to_fields(self) -> dict[str, str]:
        return {"kind": self.kind, "model": self.model, "created": str(self.created), "tenant": self.tenant,
                "include_usage": "1" if self.include_usage else "0",
                "logprobs": "" if self.logprobs is None else str(self.logprobs),
                "deadline": repr(self.deadline), "prompt_tokens": str(self.prompt_tokens),
                "source": self.source, "coalesce": self.coalesce, "tools": self.tools}

    @classmethod
    def from_fields(cls, request_id: str, raw: dict) -> RequestRecord | None:
        """None for a hash that is not a whole record (e.g. only a late ``readers`` count)."""
        f = text_fields(raw)
        try:
            return cls(request_id, f["kind"], f["model"], int(f["created"]), f["tenant"],
                       f.get("include_usage") == "1", int(f["logprobs"]) if f.get("logprobs") else None,
                       float(f.get("deadline", "0")), int(f.get("prompt_tokens", "0")), f.get("source", ""),
                       f.get("coalesce", ""), f.get("tools", ""))
        except (KeyError, ValueError):
            return None


# a follower joins a generation only if it is not being cancelled: -1, else the readers now
_JOIN = """
if redis.call('HGET', KEYS[1], 'cancelled') then return -1 end
local readers = redis.call('HINCRBY', KEYS[1], 'readers', 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return readers
"""
# the generation may be cancelled only if nobody reads it; marked so that no follower joins it after
_MARK_CANCELLED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 1 end
if (tonumber(redis.call('HGET', KEYS[1], 'readers')) or 0) > 0 then return 0 end
redis.call('HSET', KEYS[1], 'cancelled', '1')
return 1
"""


class RequestRecords:
    def __init__(self, redis, ttl_s: int):
        self.redis = redis
        self.ttl_s = ttl_s
        self._join = redis.register_script(_JOIN)
        self._mark_cancelled = redis.register_script(_MARK_CANCELLED)

    async def save(self, *records: RequestRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for record in records:
                key = record_key(record.request_id)
                pipe.hset(key, mapping=record.to_fields())
                pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def load(self, request_id: str) -> RequestRecord | None:
        return RequestRecord.from_fields(request_id, await self.redis.hgetall(record_key(request_id)))

    async def add_reader(self, request_id: str, delta: int) -> int:
        """Count a client attaching (+1) or leaving (-1); returns how many are attached now."""
        key = record_key(request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "readers", delta)
            pipe.expire(key, self.ttl_s)  # a live stream keeps its record (and a late count is not kept forever)
            readers, _ = await pipe.execute()
        return int(readers)

    async def join(self, request_id: str) -> bool:
        """Count a follower reading ``request_id``'s generation; False when that generation is being cancelled."""
        return int(await self._join(keys=[record_key(request_id)], args=[self.ttl_s])) >= 0

    async def mark_cancelled(self, request_id: str) -> bool:
        """True, and nobody can join it any more, when nobody reads the request; False when someone does."""
        return bool(await self._mark_cancelled(keys=[record_key(request_id)]))


def choice_records(first: RequestRecord, n: int) -> list[RequestRecord]:
    """The records of an n-choice request's choices, ``first`` (choice 0's) first: the same request but for
    the id, so each choice's stream is followed, counted and cancelled on its own."""
    return [first, *(dataclasses.replace(first, request_id=choice_id(first.request_id, i)) for i in range(1, n))]
