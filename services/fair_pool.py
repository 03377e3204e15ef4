"""A bounded Redis connection pool that serves the commands waiting for a connection first come, first served.

redis-py's ``BlockingConnectionPool`` waits on an ``asyncio.Condition``: a
release wakes one waiter, but a task that asks for a connection in the
meantime takes it without waiting, and the woken waiter, finding none, waits
again at the back of the line. Under steady demand above the pool's size some
commands are overtaken again and again until the pool timeout fails them while
the median command waits microseconds (benchmarks/probes/pool_fairness.py: 4
connections, 40 tasks: p50 0.02 ms, max 5.0 s, the whole run). This is what
ended ``bench frontdoor`` requests with ``No connection available`` at a
modest load: 1,000 open streams kept the gateway's 32 connections busy and a
few unlucky commands waited past the 10 s timeout.

Here a task that finds the pool busy, or others already waiting, queues; each
connection coming free goes to the first of the queue, which keeps its place
until it holds the connection, so nobody can overtake it. The timeout and its
error are the pool's own (``ConnectionError("No connection available.")``
raised from a ``TimeoutError``: pool_wait.pool_busy tells it apart).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from redis.asyncio import BlockingConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError


class FairConnectionPool(BlockingConnectionPool):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._line: deque[asyncio.Future] = deque()  # waiting tasks, in arrival order
        self._promised = 0  # turns given (a connection is theirs) whose task has not taken it yet

    async def get_connection(self, *args, **kwargs):
        if not self._line and self.can_get_connection():
            return await super().get_connection(*args, **kwargs)
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._line.append(turn)
        timer = loop.call_later(self.timeout, _expire, turn) if self.timeout is not None else None
        self._hand_on()
        try:
            try:
                await turn
            except asyncio.TimeoutError as exc:
                raise RedisConnectionError("No connection available.") from exc
            return await super().get_connection(*args, **kwargs)
        finally:
            if timer is not None:
                timer.cancel()
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self._promised -= 1  # taken, or left unused (cancelled meanwhile): free again either way
            with contextlib.suppress(ValueError):
                self._line.remove(turn)  # usually the first: cheap
            self._hand_on()

    async def release(self, connection) -> None:
        await super().release(connection)
        self._hand_on()

    def _hand_on(self) -> None:
        """Give a turn to the first waiters, one per connection free and not yet promised to an earlier one."""
        free = self.max_connections - len(self._in_use_connections)
        if self._promised >= free:
            return
        for turn in self._line:
            if not turn.done():
                turn.set_result(None)
                self._promised += 1
                if self._promised >= free:
                    return


def _expire(turn: asyncio.Future) -> None:
    if not turn.done():
        turn.set_exception(asyncio.TimeoutError())
