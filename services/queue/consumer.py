"""The router's side of the queue: fair dequeue, reclaim, ack at a final state, retry or dead-letter.

Delivery is at-least-once. An entry stays in the group's pending list from its
first delivery until ``ack`` (the request reached a final state) or a dead
letter; a consumer that dies leaves it there and ``reclaim`` (XAUTOCLAIM after
``claim_idle_ms``) hands it to another.

Fairness: ``next`` runs smooth weighted round-robin over the tiers that have
undelivered entries, inside one Lua script (scripts.DEQUEUE). With weights
8/3/1 and every tier busy, each 12 dequeues take 8 interactive, 3 standard and
1 batch, interleaved (I I S I I B I S I I S I ...); an empty tier drops out of
the rotation until it has work, so it blocks nobody and banks no credit. The
current weights live in the consumer, so each router is fair on its own.

When every tier is empty there is nothing to be fair between: ``next`` then
waits in XREADGROUP itself, which hands the next new entry of any tier to one
waiting consumer as it is added (no second round trip to dequeue it, and no
herd of idle routers woken to race for one entry).

Every entry read is screened before it is handed out:

* malformed (``QueuedRequest.from_fields`` fails) -> dead letter;
* a redelivery (count > 1) whose request already reached a final state (its
  state key says so, or its result stream ends in a final event) -> acked and
  skipped; one whose result stream ends in an error event -> dead-lettered
  without a second event (a ``fail`` that stopped between the two steps);
* past its deadline -> error event "deadline exceeded", acked, not returned;
* delivered more than ``max_deliveries`` times (consumers kept dying on it)
  -> dead letter.

``fail`` with ``retryable`` re-adds the request at the tail of its tier, with
its delivery count carried in the entry (``attempts``), so any consumer's next
read retries it; without ``retryable``, or at ``max_deliveries``, it writes the
client's error event, then dead-letters the entry (XADD to the dead stream
before the XACK, in one script). A crash between the two is healed on
redelivery by the rule above.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from redis.exceptions import ResponseError

from services.errors import InvalidRequestError
from services.queue.config import QueueConfig
from services.queue.keys import (
    ADMISSION_KEY,
    DEAD_STREAM,
    result_stream,
    state_key,
    tier_stream,
)
from services.queue.message import QueuedRequest, text, text_fields
from services.queue.results import ERROR, FINAL, ResultWriter, decode_event
from services.queue.scripts import Scripts

log = logging.getLogger(__name__)

FINAL_STATUSES = ("done", "dead", "expired")
_DELIVERY_META = ("attempts", "last_error", "last_worker")


@dataclass
class Delivery:
    entry_id: str
    tier: str
    request: QueuedRequest
    delivery_count: int  # 1 on the first delivery; counts retries and reclaims

    @property
    def request_id(self) -> str:
        return self.request.request_id


def new_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# HTTP status of an error event, by OpenAI error type (services.errors codes)
_STATUS = {"invalid_request_error": 400, "model_not_found": 404, "capacity_exceeded": 429,
           "request_aborted": 499, "kv_transfer_error": 502, "service_unavailable": 503, "deadline_exceeded": 504}


class QueueConsumer:
    def __init__(self, redis, group: str = "routers", consumer: str | None = None,
                 config: QueueConfig | None = None):
        self.redis = redis
        self.group = group
        self.consumer = consumer or new_consumer_name()
        self.config = config or QueueConfig()
        self.results = ResultWriter(redis, self.config.result_ttl_s)
        self._scripts = Scripts(redis)
        self._weights = [self.config.weights[t] for t in self.config.tiers]
        self._current = [0] * len(self.config.tiers)  # smooth weighted round-robin state
        self._groups_ready = False

    async def ensure_groups(self) -> None:
        """Create the consumer group on every tier stream (and the streams); safe to repeat."""
        for tier in self.config.tiers:
            try:
                await self.redis.xgroup_create(tier_stream(tier), self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    async def next(self, count: int = 1, block_ms: int = 0) -> list[Delivery]:
        """Up to ``count`` new deliveries in weighted-fair order; waits up to ``block_ms`` for one."""
        if count < 1 or block_ms < 0:
            raise ValueError("count must be >= 1 and block_ms >= 0")
        if not self._groups_ready:
            await self.ensure_groups()
        give_up = time.monotonic() + block_ms / 1000
        while True:
            raw, last_ids = await self._dequeue(count)
            if raw:
                deliveries = await self._screen(raw)
                if deliveries:
                    return deliveries
                continue  # all of it was expired, malformed or finished: read on
            left_ms = int((give_up - time.monotonic()) * 1000)
            if left_ms < 1:
                return []
            if count >= len(self.config.tiers):
                # Idle: take the next new entry as it arrives. XREADGROUP gives at most one per tier,
                # so this path is only for a caller with room for that many.
                raw = await self._read_new(left_ms)
                if raw:
                    deliveries = await self._screen(raw)
                    if deliveries:
                        return deliveries
                continue
            # Wake on the next XADD to any tier (ids after each tier's newest entry), then dequeue fairly.
            streams = {tier_stream(t): last for t, last in zip(self.config.tiers, last_ids)}
            await self.redis.xread(streams, count=1, block=left_ms)

    async def _read_new(self, block_ms: int) -> list[list]:
        """Wait up to ``block_ms`` for new entries (XREADGROUP ">"), at most one per tier, highest tier first."""
        streams = {tier_stream(t): ">" for t in self.config.tiers}
        try:
            reply = await self.redis.xreadgroup(self.group, self.consumer, streams, count=1, block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.ensure_groups()  # as in _dequeue
            return []
        by_stream = {text(name): entries for name, entries in (reply.items() if isinstance(reply, dict)
                                                                else reply or [])}
        return [[tier, text(eid), fields, 1] for tier in self.config.tiers
                for eid, fields in by_stream.get(tier_stream(tier), [])]

    async def _dequeue(self, count: int) -> tuple[list[list], list[str]]:
        keys = [tier_stream(t) for t in self.config.tiers]
        args = [self.group, self.consumer, count, *self._weights, *self._current]
        try:
            out, current, last = await self._scripts.dequeue(keys=keys, args=args)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.ensure_groups()  # a stream was deleted (FLUSHDB, operator): recreate and go on
            out, current, last = await self._scripts.dequeue(keys=keys, args=args)
        self._current = [int(c) for c in current]
        raw = [[self.config.tiers[int(i) - 1], text(eid), dict(zip(flat[::2], flat[1::2])), 1]
               for i, eid, flat in out]
        return raw, [text(x) for x in last]

    async def reclaim(self, min_idle_ms: int | None = None, count: int = 100) -> list[Delivery]:
        """Take over entries other consumers left pending for ``min_idle_ms`` (default ``claim_idle_ms``)."""
        min_idle = self.config.claim_idle_ms if min_idle_ms is None else min_idle_ms
        if not self._groups_ready:
            await self.ensure_groups()
        raw: list[list] = []
        for tier in self.config.tiers:
            cursor = "0-0"
            while len(raw) < count:
                reply = await self.redis.xautoclaim(tier_stream(tier), self.group, self.consumer, min_idle,
                                                    cursor, count=count - len(raw))
                cursor = text(reply[0])
                raw.extend([tier, text(eid), fields, 0] for eid, fields in reply[1] if fields is not None)
                if cursor == "0-0":
                    break
        if not raw:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for tier, eid, _, _ in raw:
                pipe.xpending_range(tier_stream(tier), self.group, min=eid, max=eid, count=1)
            pending = await pipe.execute()
        for item, info in zip(raw, pending):
            item[3] = int(info[0]["times_delivered"]) if info else 1
        return await self._screen(raw)

    async def ack(self, delivery: Delivery) -> None:
        """The request reached a final state (its final or error event is written): release it for good."""
        await self._finalize(delivery.tier, delivery.entry_id, delivery.request_id, "done")

    async def expire(self, delivery: Delivery, message: str = "deadline exceeded") -> None:
        """The request's deadline passed: a deadline error on its result stream (choice 0's with n > 1: the
        gateway ends the response at any choice's first error), then final as "expired" (not a dead
        letter: nothing there for an operator to look at)."""
        await self.results.error(delivery.request_id, "deadline_exceeded", message, _STATUS["deadline_exceeded"])
        await self._finalize(delivery.tier, delivery.entry_id, delivery.request_id, "expired")

    async def fail(self, delivery: Delivery, error: str, worker: str, retryable: bool = True,
                   code: str = "internal_error") -> str:
        """A delivery failed: retry it, or dead-letter it when not retryable or out of deliveries.

        Returns ``"retried"``, ``"dead_lettered"``, or ``"not_owner"`` (another consumer
        reclaimed the entry meanwhile; it decides).
        """
        if not retryable or delivery.delivery_count >= self.config.max_deliveries:
            await self._dead_letter(delivery, error, worker, code)
            return "dead_lettered"
        flat = [x for kv in delivery.request.to_fields().items() for x in kv]
        new_id = await self._scripts.retry(
            keys=[tier_stream(delivery.tier), state_key(delivery.request_id)],
            args=[self.group, self.consumer, delivery.entry_id, delivery.delivery_count, error, worker, *flat])
        return "retried" if new_id is not None else "not_owner"

    # -- screening and final states --------------------------------------------------------

    async def _screen(self, raw: list[list]) -> list[Delivery]:
        candidates: list[Delivery] = []
        for tier, entry_id, fields, times_delivered in raw:
            fields = text_fields(fields)
            try:
                request = QueuedRequest.from_fields(fields)
                if request.tier != tier:
                    raise InvalidRequestError(f"entry on the {tier!r} stream names tier {request.tier!r}")
                attempts = int(fields.get("attempts", "0"))
            except (InvalidRequestError, ValueError) as exc:
                await self._dead_letter_malformed(tier, entry_id, fields, str(exc), times_delivered)
                continue
            candidates.append(Delivery(entry_id, tier, request, attempts + times_delivered))

        seen: dict[str, tuple] = {}
        redelivered = [d for d in candidates if d.delivery_count > 1]
        if redelivered:  # a previous delivery may have got further than its consumer told us
            async with self.redis.pipeline(transaction=False) as pipe:
                for d in redelivered:
                    pipe.hmget(state_key(d.request_id), "status", "last_error", "worker")
                    pipe.xrevrange(result_stream(d.request_id), "+", "-", count=1)
                replies = await pipe.execute()
            for i, d in enumerate(redelivered):
                state, tail = replies[2 * i], replies[2 * i + 1]
                event = decode_event(tail[0][1]) if tail else (None, None)
                seen[d.entry_id] = (*[None if v is None else text(v) for v in state], *event)

        out, now = [], time.time()
        for d in candidates:
            status, last_error, last_worker, event_type, event_data = seen.get(d.entry_id, (None,) * 5)
            if status in FINAL_STATUSES or event_type == FINAL:
                await self._finalize(d.tier, d.entry_id, d.request_id, "done")
            elif event_type == ERROR:
                data = event_data if isinstance(event_data, dict) else {}
                if data.get("code") == "deadline_exceeded":
                    await self._finalize(d.tier, d.entry_id, d.request_id, "expired")
                else:
                    await self._dead_letter(d, str(data.get("message", "error")), last_worker or "",
                                            str(data.get("code", "internal_error")), client_told=True)
            elif d.request.expired(now):
                await self.expire(d)
            elif d.delivery_count > self.config.max_deliveries:
                reason = last_error or "its consumer stopped before reporting an error"
                await self._dead_letter(d, f"gave up after {d.delivery_count} deliveries; last error: {reason}",
                                        last_worker or "", "internal_error")
            else:
                out.append(d)
        return out

    async def _finalize(self, tier: str, entry_id: str, request_id: str, status: str,
                        dead_fields: dict[str, str] | None = None) -> str:
        flat = [x for kv in (dead_fields or {}).items() for x in kv]
        reply = await self._scripts.finalize(
            keys=[tier_stream(tier), DEAD_STREAM, ADMISSION_KEY, state_key(request_id)],
            args=[self.group, entry_id, status, self.config.state_ttl_s, *flat])
        return text(reply)

    async def _dead_letter(self, d: Delivery, error: str, worker: str, code: str,
                           client_told: bool = False) -> str:
        if not client_told:  # first: a crash after this is healed on redelivery (see the module docstring)
            await self.results.error(d.request_id, code, error, _STATUS.get(code, 500))
        fields = d.request.to_fields()
        fields.update(self._dead_meta(d.tier, d.entry_id, error, code, worker, d.delivery_count))
        dead_id = await self._finalize(d.tier, d.entry_id, d.request_id, "dead", fields)
        log.warning("request %s dead-lettered as %s after %d deliveries: %s", d.request_id, dead_id,
                    d.delivery_count, error)
        return dead_id

    async def _dead_letter_malformed(self, tier: str, entry_id: str, fields: dict[str, str], error: str,
                                     times_delivered: int) -> str:
        request_id = fields.get("request_id", "")
        try:
            QueuedRequest(request_id, "", tier, "", [0])  # a usable id names a result stream to tell
        except InvalidRequestError:
            request_id = ""
        if request_id:
            await self.results.error(request_id, "invalid_request_error", f"malformed queued request: {error}", 400)
        attempts = fields.get("attempts", "")
        deliveries = times_delivered + (int(attempts) if attempts.isdigit() else 0)
        dead = {k: v for k, v in fields.items() if k not in _DELIVERY_META}
        dead.update(self._dead_meta(tier, entry_id, f"malformed queue entry: {error}", "invalid_request_error",
                                    self.consumer, deliveries))
        dead_id = await self._finalize(tier, entry_id, request_id or "-", "dead", dead)
        log.warning("malformed entry %s on tier %s dead-lettered as %s: %s", entry_id, tier, dead_id, error)
        return dead_id

    @staticmethod
    def _dead_meta(tier: str, entry_id: str, error: str, code: str, worker: str, deliveries: int) -> dict:
        return {"last_error": error, "error_code": code, "worker": worker, "delivery_count": str(deliveries),
                "tier": tier, "entry_id": entry_id, "dead_at": repr(time.time())}
