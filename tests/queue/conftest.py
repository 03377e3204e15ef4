import asyncio
import itertools

import pytest
import redis.asyncio as aioredis

from services.queue import QueuedRequest

_ids = itertools.count()


@pytest.fixture
def with_redis(redis_url):
    """``with_redis(fn)`` runs ``await fn(client)`` in a fresh event loop on an emptied database.

    The queue's keys have fixed names, so each test starts from an empty database;
    tests run serially, so no one else's keys are lost mid-test.
    """

    def run(fn):
        async def go():
            client = aioredis.Redis.from_url(redis_url)
            try:
                await client.flushdb()
                return await asyncio.wait_for(fn(client), 30)
            finally:
                await client.aclose()

        return asyncio.run(go())

    return run


def make_request(tier: str = "standard", tokens: int = 4, **overrides) -> QueuedRequest:
    n = next(_ids)
    fields = {"request_id": f"req-{n}", "tenant": "acme", "tier": tier, "model": "smollm2",
              "token_ids": [(n * 7 + i) % 1000 for i in range(tokens)],
              "sampling": {"temperature": 0.0, "max_tokens": 8}}
    fields.update(overrides)
    return QueuedRequest(**fields)
