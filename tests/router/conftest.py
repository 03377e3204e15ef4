import asyncio

import pytest
import redis.asyncio as aioredis


@pytest.fixture
def with_redis(redis_url):
    """``with_redis(fn)`` runs ``await fn(client)`` in a fresh event loop on an emptied database.

    The stream and registry keys have fixed names, so each test starts from an empty
    database; the tests run serially, so no one else's keys are lost mid-test.
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
