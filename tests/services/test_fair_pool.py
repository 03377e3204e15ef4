"""The bounded Redis pool every pdserve process uses (services/fair_pool.py): commands waiting for a
connection get one in arrival order, and one that waits too long fails as the pool's timeout."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from services.fair_pool import FairConnectionPool
from services.gateway.pool_wait import pool_busy


async def _line_then_newcomer(url: str) -> list[str]:
    """One connection, held; a command queues for it; the holder gives it back and asks again at once."""
    pool = FairConnectionPool.from_url(url, max_connections=1, timeout=5)
    order: list[str] = []
    held = await pool.get_connection()

    async def waiting():
        conn = await pool.get_connection()
        order.append("waiting")
        await pool.release(conn)

    task = asyncio.create_task(waiting())
    await asyncio.sleep(0.05)  # it is in line
    await pool.release(held)
    conn = await pool.get_connection()  # the same turn of the loop: redis-py's own pool hands it this one
    order.append("newcomer")
    await pool.release(conn)
    await task
    await pool.disconnect()
    return order


def test_a_command_waiting_for_a_connection_is_not_overtaken(redis_url):
    # with redis-py's BlockingConnectionPool the newcomer wins, and under steady demand a waiting command
    # can lose every time until its timeout (benchmarks/probes/pool_fairness.py: max wait 5 s at p50 0.02 ms)
    assert asyncio.run(_line_then_newcomer(redis_url)) == ["waiting", "newcomer"]


def test_every_command_of_a_crowd_is_served_and_connections_stay_bounded(redis_url):
    async def crowd():
        pool = FairConnectionPool.from_url(redis_url, max_connections=3, timeout=30)
        client = Redis.from_pool(pool)
        peak = 0

        async def one(i: int) -> str:
            nonlocal peak
            peak = max(peak, len(pool._in_use_connections))
            return await client.echo(f"m{i}")

        replies = await asyncio.gather(*(one(i) for i in range(300)))
        await client.aclose()
        return replies, peak

    replies, peak = asyncio.run(crowd())
    assert [r.decode() if isinstance(r, bytes) else r for r in replies] == [f"m{i}" for i in range(300)]
    assert peak <= 3


def test_a_command_that_waits_past_the_timeout_fails_as_a_busy_pool(redis_url):
    async def wait_too_long():
        pool = FairConnectionPool.from_url(redis_url, max_connections=1, timeout=0.2)
        held = await pool.get_connection()
        try:
            with pytest.raises(Exception) as caught:
                await pool.get_connection()
            assert not pool._line  # it left the line
            await pool.release(held)
            again = await pool.get_connection()  # and the pool still serves
            await pool.release(again)
        finally:
            await pool.disconnect()
        return caught.value

    exc = asyncio.run(wait_too_long())
    assert pool_busy(exc) and "No connection available" in str(exc)
