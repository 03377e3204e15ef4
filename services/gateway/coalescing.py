"""Request coalescing: identical requests in flight are computed once, across every gateway replica.

A request whose output is fully determined by what it asks for (greedy, or
sampled with an explicit seed) gets a coalescing key: a hash of the tenant,
the priority tier, the model, the templated prompt's token ids and every
sampling parameter (max_tokens, stop, penalties, logprobs, seed, ...). The
first such request claims ``pd:{q}:co:<hash>`` (an atomic set-if-absent whose
value names its request id and deadline, with a TTL of its deadline) and is
queued as usual, in the same step (the queue's enqueue script claims the key and
queues the entry together): it is the *leader*. A later identical request finds the key
and is queued nowhere: it is a *follower*, with its own request id, record,
``created`` and usage, whose record names the leader's request id as its
``source``; the gateway then reads the leader's result stream for it from the
start (core.follow), so it sees the same events, however late it joined.

    leader  A: claim key -> A | record A | queue A | result stream pd:res:..:A
    follower B: claim key -> A | record B (source A)        reads pd:res:..:A
    follower C (another replica): the same                  reads pd:res:..:A

The key lives in Redis rather than in one gateway's memory so that twins that
a load balancer spread over replicas meet too (retry storms rarely come back
to the same replica); claimed inside the enqueue, it costs a leader no round trip of
its own (a follower: one more, to see that the leader is not being cancelled). Who may
share: the key includes the tenant (a twin's fast first token would tell one
tenant what another is asking, the same side channel a shared prefix cache
has) and the tier (a high-priority twin must not wait in a low tier's queue).
Never shared: temperature > 0 without a seed (each such request must draw its
own sample). A follower joins only a leader whose deadline is not much earlier
than its own (``_DEADLINE_SLACK``), since the leader's deadline ends both.

Every subscriber, leader or follower, counts as a reader of the leader's
record (core.attach), so one client leaving cancels nothing while another
reads; the generation is cancelled when the last one has gone for the grace
period. The cancel first marks the record ``cancelled`` (atomically, only if
nobody reads it), and a follower attaches only to a generation not so marked,
so a late twin never joins a generation being cancelled: it is told to retry
(503) in that millisecond window, or, when it sees the mark before it has
joined, it claims the key itself. The key is deleted (only if it still names
its leader) by whoever sees the leader's terminal event, by the cancel, and
when the leader could not be queued (its error event, written to its result
stream, fails its followers with the same error); the TTL covers a gateway
that died in between.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from services.engine.sampling_params import SamplingParams
from services.gateway.request_record import record_key
from services.queue.admission import Claim
from services.queue.message import text

_DEADLINE_SLACK = 0.1  # a follower may lose this share of its remaining time to the leader's earlier deadline
_CLAIM = """
local value = redis.call('GET', KEYS[1])
if value then return value end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""
_RELEASE = """
local value = redis.call('GET', KEYS[1])
if value and string.sub(value, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. '|' then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Role(enum.Enum):
    LEAD = "lead"  # claimed the key: queue it; twins follow it
    FOLLOW = "follow"  # an identical request is in flight: read its results
    ALONE = "alone"  # not coalesced (its deadline is much later than the leader's): queue it, claim nothing


def coalescible(sampling: dict[str, Any]) -> bool:
    """Output determined by the request: greedy (temperature 0) or an explicit seed. Temperature defaults to 1."""
    return sampling.get("temperature", 1.0) == 0 or sampling.get("seed") is not None


def coalescing_key(tenant: str, tier: str, model: str, token_ids: Sequence[int], sampling: dict[str, Any]) -> str:
    """The Redis key shared by identical requests: everything that changes the output, and who may share."""
    # every parameter spelled out (defaults too), so {"temperature": 0} over HTTP and the gRPC API's full set
    # with the same values are one key
    params = dataclasses.asdict(SamplingParams(**sampling))
    for f in dataclasses.fields(SamplingParams):  # JSON's 0 and protobuf's 0.0 are one temperature
        if f.type == "float":
            params[f.name] = float(params[f.name])
    what = json.dumps([tenant, tier, model, list(token_ids), params], sort_keys=True, separators=(",", ":"))
    # in the queue's slot ({q}), so the enqueue script can claim it beside the queue's keys on Redis Cluster
    return f"pd:{{q}}:co:{hashlib.sha256(what.encode()).hexdigest()[:40]}"


class Coalescer:
    def __init__(self, redis, enabled: bool = True):
        self.redis = redis
        self.enabled = enabled
        self._claim = redis.register_script(_CLAIM)
        self._release = redis.register_script(_RELEASE)

    def key(self, tenant: str, tier: str, model: str, token_ids: Sequence[int], sampling: dict) -> str | None:
        """The request's coalescing key, or None when it must be computed on its own (or coalescing is off)."""
        if not self.enabled or not coalescible(sampling):
            return None
        return coalescing_key(tenant, tier, model, token_ids, sampling)

    @staticmethod
    def claim_for(key: str, request_id: str, deadline: float) -> Claim:
        """The claim a request would make: the key's value names it and its deadline, for its time left + 1 s."""
        ttl_ms = max(1000, int((deadline - time.time()) * 1000) + 1000)
        return Claim(key, f"{request_id}|{deadline!r}", ttl_ms)

    async def judge(self, key: str, request_id: str, deadline: float, holder: str) -> tuple[Role, str] | None:
        """The key holds ``holder`` ("<leader>|<deadline>"): follow that leader, stay alone (its deadline is
        much earlier), or None when the leader is being cancelled (its key is let go: claim again)."""
        leader, _, leader_deadline = holder.partition("|")
        if leader == request_id:
            return Role.LEAD, request_id
        now = time.time()
        if float(leader_deadline or 0) < deadline - _DEADLINE_SLACK * max(0.0, deadline - now):
            return Role.ALONE, request_id
        if await self.redis.hget(record_key(leader), "cancelled") is None:
            return Role.FOLLOW, leader
        await self.release(key, leader)
        return None

    async def claim(self, key: str, request_id: str, deadline: float) -> tuple[Role, str]:
        """(role, the request id whose results to read): (LEAD, own id), (FOLLOW, leader's) or (ALONE, own id).
        The claim alone, before queueing (an Idempotency-Key's request); without one the gateway claims in its
        enqueue (AdmissionQueue.admit's ``claim``), one round trip for both."""
        for _ in range(2):  # a second time after clearing a key whose leader is being cancelled
            claim = self.claim_for(key, request_id, deadline)
            decided = await self.judge(key, request_id, deadline,
                                       text(await self._claim(keys=[key], args=[claim.value, claim.ttl_ms])))
            if decided is not None:
                return decided
        return Role.ALONE, request_id

    async def release(self, key: str, leader: str) -> None:
        """Forget the key if it still names ``leader`` (its generation ended, or is ending)."""
        await self._release(keys=[key], args=[leader])
