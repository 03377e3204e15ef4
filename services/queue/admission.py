"""Admission: put a request on its tier's stream, once, or refuse it while the queue is full.

``enqueue`` is one Lua script (scripts.ENQUEUE): it checks the request's state
key, counts the queued requests (XLEN of every tier stream: finished entries are
deleted, unfinished ones never trimmed) and queued prompt tokens (the admission
hash), and only then XADDs the entry and writes the state key, so two gateways
racing on one request id enqueue it once, and a full queue admits nothing. With a
``Claim`` it also claims the gateway's coalescing key in the same step (only if the
key is free, and only if the request is queued): a request that leads its twins
is claimed and queued in one round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.errors import CapacityError, InvalidRequestError
from services.queue.config import QueueConfig
from services.errors import NotFoundError
from services.queue.keys import ADMISSION_KEY, DEAD_STREAM, state_key, tier_stream
from services.queue.message import QueuedRequest, text
from services.queue.scripts import Scripts


@dataclass(frozen=True)
class Claim:
    """A coalescing key to claim with the enqueue (services/gateway/coalescing.py): set to ``value`` for
    ``ttl_ms`` if it is free; a ``{q}`` key, so the script may touch it beside the queue's on Cluster."""
    key: str
    value: str
    ttl_ms: int


@dataclass(frozen=True)
class Admitted:
    entry_id: str  # the entry the request was first queued as ("" when claimed_by is set)
    duplicate: bool  # True: the request id was already known, nothing was queued
    claimed_by: str | None = None  # the claim's key already held this value: nothing was queued or claimed


@dataclass
class TierDepth:
    requests: int  # not yet at a final state: waiting plus being processed
    prompt_tokens: int


@dataclass
class QueueDepth:
    tiers: dict[str, TierDepth] = field(default_factory=dict)
    dead: int = 0  # entries in the dead-letter stream

    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.tiers.values())

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.tiers.values())


def capacity_error(message: str, retry_after_s: float) -> CapacityError:
    exc = CapacityError(message)
    exc.retry_after_s = retry_after_s  # the gateway's Retry-After
    return exc


class AdmissionQueue:
    def __init__(self, redis, config: QueueConfig | None = None):
        self.redis = redis
        self.config = config or QueueConfig()
        self._scripts = Scripts(redis)

    async def enqueue(self, req: QueuedRequest) -> str:
        """Queue ``req``; returns its entry id (the original one when the request id was queued before).

        Raises ``CapacityError`` (with ``retry_after_s``) when the queue is full, and
        ``InvalidRequestError`` for an unknown tier or a prompt that could never fit.
        """
        return (await self.admit(req)).entry_id

    async def admit(self, req: QueuedRequest, *, redrive_dead_id: str = "", claim: Claim | None = None) -> Admitted:
        """``enqueue``, also saying whether the request id was a duplicate.

        With ``redrive_dead_id`` the request replaces that dead letter: its old state is
        dropped, it is queued afresh and the dead letter is deleted, all in one step.
        With ``claim``, its key is claimed in the same step if free (``claimed_by`` None);
        if another holds it, nothing is queued and ``claimed_by`` is the holder's value.
        """
        cfg = self.config
        if req.tier not in cfg.tiers:
            raise InvalidRequestError(f"unknown priority tier {req.tier!r}; tiers are {list(cfg.tiers)}",
                                      param="tier")
        if req.prompt_tokens > cfg.max_queued_prompt_tokens:
            raise InvalidRequestError(f"prompt has {req.prompt_tokens} tokens; the queue admits at most "
                                      f"{cfg.max_queued_prompt_tokens} queued prompt tokens")
        flat = [x for kv in req.to_fields().items() for x in kv]
        keys = [state_key(req.request_id), ADMISSION_KEY, tier_stream(req.tier), DEAD_STREAM,
                claim.key if claim else ADMISSION_KEY, *(tier_stream(t) for t in cfg.tiers)]
        args = [req.tier, req.prompt_tokens, cfg.max_queued_requests, cfg.max_queued_prompt_tokens,
                redrive_dead_id, claim.value if claim else "", claim.ttl_ms if claim else 0, *flat]
        reply = [text(x) for x in await self._scripts.enqueue(keys=keys, args=args)]
        outcome = reply[0]
        if outcome == "ok":
            return Admitted(reply[1], duplicate=False)
        if outcome == "exists":
            return Admitted(reply[1], duplicate=True)
        if outcome == "claimed":
            return Admitted("", duplicate=False, claimed_by=reply[1])
        if outcome == "full":
            limit = cfg.max_queued_requests if reply[1] == "requests" else cfg.max_queued_prompt_tokens
            raise capacity_error(f"the queue is full ({reply[2]} queued {reply[1]}, limit {limit}); "
                                 f"retry after {cfg.retry_after_s:g} s", cfg.retry_after_s)
        if outcome == "missing":
            raise NotFoundError(f"no dead letter with id {redrive_dead_id!r}")
        if outcome == "queued":
            raise InvalidRequestError(f"request {req.request_id!r} is queued again (entry {reply[1]}); "
                                      f"not re-driving its dead letter {redrive_dead_id!r}")
        raise RuntimeError(f"unexpected reply from the enqueue script: {reply}")

    async def depth(self) -> QueueDepth:
        """Queued requests and prompt tokens per tier (backpressure, ``pdserve_queue_depth``)."""
        tiers = self.config.tiers
        async with self.redis.pipeline(transaction=False) as pipe:
            for tier in tiers:
                pipe.xlen(tier_stream(tier))
            pipe.hgetall(ADMISSION_KEY)
            pipe.xlen(DEAD_STREAM)
            replies = await pipe.execute()
        tokens = {text(k): int(v) for k, v in replies[len(tiers)].items()}
        return QueueDepth(
            tiers={t: TierDepth(int(n), tokens.get(f"tokens:{t}", 0)) for t, n in zip(tiers, replies)},
            dead=int(replies[-1]))

    async def state(self, request_id: str) -> dict[str, str] | None:
        """A request's state hash (status, entry, tier, ...), or None when unknown or expired."""
        state = await self.redis.hgetall(state_key(request_id))
        return {text(k): text(v) for k, v in state.items()} or None
