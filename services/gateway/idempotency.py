"""Idempotency-Key: a retried POST attaches to the original request instead of queueing it again.

``pd:gw:idem:<tenant>:<sha256 of the key>`` holds the request id, set with NX
and a TTL, so of two racing POSTs with one key exactly one queues; the other
(and every later retry within the TTL) attaches to the winner's result stream.
Keys are per tenant: two tenants may use the same key for different requests.
A request refused after it claimed its key (the queue was full) releases it, so
the client's retry with the same key is admitted afresh.
"""

from __future__ import annotations

import hashlib

from services.errors import InvalidRequestError
from services.queue.message import text

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def validate_key(key: str) -> str:
    if not 1 <= len(key) <= 255 or not key.isascii() or not key.isprintable():
        raise InvalidRequestError("Idempotency-Key must be 1-255 printable ASCII characters", param="Idempotency-Key")
    return key


def idempotency_key(tenant: str, key: str) -> str:
    return f"pd:gw:idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()[:32]}"


class IdempotencyKeys:
    def __init__(self, redis, ttl_s: int):
        self.redis = redis
        self.ttl_s = ttl_s
        self._release = redis.register_script(_RELEASE)

    async def lookup(self, tenant: str, key: str) -> str | None:
        value = await self.redis.get(idempotency_key(tenant, key))
        return None if value is None else text(value)

    async def claim(self, tenant: str, key: str, request_id: str) -> str:
        """The request id the key stands for: ``request_id`` if this call claimed it, else the earlier one."""
        name = idempotency_key(tenant, key)
        if await self.redis.set(name, request_id, nx=True, ex=self.ttl_s):
            return request_id
        existing = await self.redis.get(name)
        if existing is None:  # expired between the two calls: try once more
            return request_id if await self.redis.set(name, request_id, nx=True, ex=self.ttl_s) else \
                text(await self.redis.get(name) or request_id)
        return text(existing)

    async def release(self, tenant: str, key: str, request_id: str) -> None:
        await self._release(keys=[idempotency_key(tenant, key)], args=[request_id])
