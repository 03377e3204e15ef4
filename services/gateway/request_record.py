"""What a resumed stream needs to look like the original: one small Redis hash per request.

``pd:gw:req:<request_id>`` is written before the request is queued (so whoever
finds the request id, through an Idempotency-Key or the events endpoint, finds
its record) and expires after ``ttl_s``. ``readers`` counts the clients attached
to the request's result stream right now, on every gateway replica: a request is
cancelled only when its last reader left and nobody re-attached within the grace
period (core.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.queue.message import text_fields

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

    def to_fields(self) -> dict[str, str]:
        return {"kind": self.kind, "model": self.model, "created": str(self.created), "tenant": self.tenant,
                "include_usage": "1" if self.include_usage else "0",
                "logprobs": "" if self.logprobs is None else str(self.logprobs),
                "deadline": repr(self.deadline), "prompt_tokens": str(self.prompt_tokens)}

    @classmethod
    def from_fields(cls, request_id: str, raw: dict) -> RequestRecord | None:
        """None for a hash that is not a whole record (e.g. only a late ``readers`` count)."""
        f = text_fields(raw)
        try:
            return cls(request_id, f["kind"], f["model"], int(f["created"]), f["tenant"],
                       f.get("include_usage") == "1", int(f["logprobs"]) if f.get("logprobs") else None,
                       float(f.get("deadline", "0")), int(f.get("prompt_tokens", "0")))
        except (KeyError, ValueError):
            return None


class RequestRecords:
    def __init__(self, redis, ttl_s: int):
        self.redis = redis
        self.ttl_s = ttl_s

    async def save(self, record: RequestRecord) -> None:
        key = record_key(record.request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
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

    async def readers(self, request_id: str) -> int:
        value = await self.redis.hget(record_key(request_id), "readers")
        return int(value) if value is not None else 0
