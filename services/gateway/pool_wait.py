"""After the 200: a busy Redis pool is waited out, not answered with an error event.

Before a request is queued, every pooled connection busy past the pool timeout
is a 503 with Retry-After (http_errors.as_pdserve): the client comes back later.
Once a stream has sent its 200 the request is queued and being served, and the
stream's own round trips (counting its reader, catching its subscription up,
the quiet check before a heartbeat, uncounting the reader at the end) wait for
a connection until the request's deadline. A burst that keeps the gateway's
pool busy for longer than its timeout then slows those streams down instead
of ending them with an error after their 200 (``bench frontdoor`` saw 102-136
of 1,500 streams end so on a loaded machine). Redis itself away (a refused or
dropped connection) still ends them: that is not a queue of our own commands.

    await patiently(lambda: records.add_reader(rid, 1), until=record.deadline)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError

T = TypeVar("T")
FIRST_WAIT_S = 0.05
MOST_WAIT_S = 1.0


def pool_busy(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py's bounded pool finding every connection busy past its timeout (its
    ConnectionError raised from the wait's TimeoutError), not Redis refusing or dropping a connection."""
    return isinstance(exc, RedisConnectionError) and isinstance(exc.__cause__, (asyncio.TimeoutError, TimeoutError))


async def patiently(op: Callable[[], Awaitable[T]], until: float) -> T:
    """``await op()``, again after a growing pause while the pool is busy, until the wall-clock ``until``;
    then (or on any other error) the error is raised."""
    pause = FIRST_WAIT_S
    while True:
        try:
            return await op()
        except RedisConnectionError as exc:
            if not pool_busy(exc) or time.time() + pause > until:
                raise
        await asyncio.sleep(pause)
        pause = min(MOST_WAIT_S, pause * 2)
