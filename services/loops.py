"""The background loops of a component (the router's worker pool, KV-event follower, queue worker, queue-lag monitor).

Each loop runs ``while not loops.stopping:`` around a Redis call. Stopping takes more than
one cancel: redis-py can swallow a cancellation that lands as a reply arrives (redis-py
issue #2028) and carry on with the next read. So ``stop`` sets the flag, which ends a loop
after that read, and cancels again until every task is gone; a task that had failed is
logged, not lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

log = logging.getLogger(__name__)


class Loops:
    def __init__(self):
        self.stopping = False
        self._tasks: list[asyncio.Task] = []

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    def start(self, loops: dict[str, Callable[[], Coroutine]]) -> None:
        """Start each ``{task name: coroutine function}`` as a task, unless these loops already run."""
        if self._tasks:
            return
        self.stopping = False
        self._tasks = [asyncio.create_task(fn(), name=name) for name, fn in loops.items()]

    async def stop(self, wait_s: float) -> None:
        """Flag, then cancel every ``wait_s`` seconds until all tasks have ended."""
        self.stopping = True
        tasks, self._tasks = self._tasks, []
        pending = {t for t in tasks if not t.done()}
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=wait_s)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s failed: %r", task.get_name(), task.exception())
