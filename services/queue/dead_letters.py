"""The dead-letter stream ``pd:{q}:dead``: requests that failed for good, kept for an operator.

Each entry holds the request's original fields (message.py) plus
``last_error``, ``error_code``, ``worker``, ``delivery_count``, ``tier``,
``entry_id`` (the tier-stream entry that was given up on) and ``dead_at``.
Dead letters are never trimmed; an operator inspects them and re-drives them
(``pdserve deadletters``).

Re-driving queues the request again as new: a fresh state key (delivery history
reset), enqueued now, with its original time budget (deadline minus enqueue
time) counted from now. It goes through admission like any request, and the
dead letter is deleted in the same atomic step. Only once it is queued are the
old run's events (ending in the error event) deleted from its result stream, so
a reader sees the new run from the start, and a re-drive that admission refuses
(queue full, queued again) leaves the client's error event where it was. The
result stream lives in another Cluster slot than the queue, so this is a second
step: it deletes the entries up to the last one the old run wrote, never what
the new run (a router may start it at once) wrote since.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, replace

from services.errors import InvalidRequestError
from services.queue.admission import AdmissionQueue
from services.queue.config import QueueConfig
from services.errors import NotFoundError
from services.queue.keys import DEAD_STREAM, result_stream
from services.queue.message import QueuedRequest, text, text_fields

_ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")

# KEYS: the request's result stream. ARGV: the last entry id the old run wrote.
# Nothing written since: the whole stream goes; else only the old run's entries.
_FORGET_OLD_RUN = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 then return 0 end
if last[1][1] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
local old = redis.call('XRANGE', KEYS[1], '-', ARGV[1])
for _, entry in ipairs(old) do redis.call('XDEL', KEYS[1], entry[1]) end
return #old
"""


@dataclass
class DeadLetter:
    dead_id: str  # entry id in the dead-letter stream
    request_id: str
    tier: str
    last_error: str
    error_code: str
    worker: str
    delivery_count: int
    entry_id: str  # the tier-stream entry it was delivered as
    dead_at: float
    fields: dict[str, str]  # everything stored, the request's own fields included

    @classmethod
    def from_entry(cls, dead_id, fields) -> DeadLetter:
        f = text_fields(fields)

        def number(name, kind):
            try:
                return kind(f.get(name, "0"))
            except ValueError:
                return kind(0)

        return cls(dead_id=text(dead_id), request_id=f.get("request_id", ""), tier=f.get("tier", ""),
                   last_error=f.get("last_error", ""), error_code=f.get("error_code", ""),
                   worker=f.get("worker", ""), delivery_count=number("delivery_count", int),
                   entry_id=f.get("entry_id", ""), dead_at=number("dead_at", float), fields=f)

    def request(self) -> QueuedRequest:
        """The original request; ``InvalidRequestError`` when the dead letter was a malformed entry."""
        return QueuedRequest.from_fields(self.fields)  # the dead-letter fields beside them are ignored

    def to_dict(self) -> dict:
        return asdict(self)


def _check_id(dead_id: str) -> str:
    if not isinstance(dead_id, str) or not _ENTRY_ID.fullmatch(dead_id):
        raise InvalidRequestError(f"not a dead-letter id (expected <ms>-<seq>): {dead_id!r}")
    return dead_id


class DeadLetters:
    def __init__(self, redis, config: QueueConfig | None = None):
        self.redis = redis
        self.admission = AdmissionQueue(redis, config)
        self._forget_old_run = redis.register_script(_FORGET_OLD_RUN)

    async def count(self) -> int:
        return int(await self.redis.xlen(DEAD_STREAM))

    async def list(self, limit: int = 100, after: str = "-") -> list[DeadLetter]:
        """The oldest ``limit`` dead letters (after the id ``after``, exclusive, for paging)."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        start = after if after == "-" else "(" + _check_id(after)
        entries = await self.redis.xrange(DEAD_STREAM, start, "+", count=limit)
        return [DeadLetter.from_entry(dead_id, fields) for dead_id, fields in entries]

    async def show(self, dead_id: str) -> DeadLetter:
        entries = await self.redis.xrange(DEAD_STREAM, _check_id(dead_id), dead_id, count=1)
        if not entries:
            raise NotFoundError(f"no dead letter with id {dead_id!r}")
        return DeadLetter.from_entry(*entries[0])

    async def redrive(self, dead_id: str) -> str:
        """Queue the dead letter's request again as new; returns its new entry id."""
        letter = await self.show(dead_id)
        try:
            original = letter.request()
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"dead letter {dead_id} holds a malformed entry and cannot be re-driven: "
                                      f"{exc.message}") from None
        now = time.time()
        budget = original.deadline - original.enqueued_at if original.deadline else 0.0
        fresh = replace(original, enqueued_at=now, deadline=now + max(budget, 0.0) if original.deadline else 0.0)
        stream = result_stream(fresh.request_id)
        old_run = await self.redis.xrevrange(stream, "+", "-", count=1)
        entry_id = (await self.admission.admit(fresh, redrive_dead_id=dead_id)).entry_id
        if old_run:
            await self._forget_old_run(keys=[stream], args=[text(old_run[0][0])])
        return entry_id

    async def redrive_all(self) -> list[tuple[str, str]]:
        """Re-drive every dead letter, oldest first; ``(dead id, new entry id)`` per request.

        Stops at the first one that cannot go (queue full, malformed): those before it
        are queued, it and those after it stay dead letters.
        """
        done = []
        while letters := await self.list(limit=100):
            for letter in letters:
                done.append((letter.dead_id, await self.redrive(letter.dead_id)))
        return done
