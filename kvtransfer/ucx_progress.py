"""Progressing the UCX worker from the asyncio event loop, asleep while idle.

ucxx's ``blocking`` progress mode (0.52) never re-arms the worker after the
first event on its file descriptor, so the descriptor stays readable and the
event loop calls ``worker.progress()`` on every turn: a process holding one
UCX endpoint used a whole core while doing nothing (2 to 3 s of CPU in 3 s
idle, measured here), taking it from the model running beside it.

``EventLoopProgress`` is the classic UCX blocking pattern: when the worker's
epoll descriptor fires, stop watching it and progress until ``arm()``
succeeds (``arm`` fails while events are pending; the ``sock_recv`` on a
closed socketpair returns only after every other ready callback ran, so
``arm`` is attempted when the loop is about to sleep), then watch the
descriptor again. Idle cost measured here: 0.0006 s of CPU in 3 s; transfer
speed the same as the busy loop within noise (about 1.1 GB/s for 189 MB on
this busy 2-core machine, both ways). A one-second tick progresses the
worker in case a wake-up was ever missed, as ucxx's own mode does.

It is installed per event loop before ucxx creates its context or its own
progress task, through ucxx's per-loop registry ``ProgressTasks`` (a
private name of ucxx 0.52: pin the minor version).

With ``UCXPY_PROGRESS_MODE=thread`` (and ``UCXPY_ENABLE_PYTHON_FUTURE=1``,
without which each awaited request is polled from the event loop while the
progress thread holds the GIL) ucxx progresses on its own thread; the only
thing done here then is stopping its notifier thread when the loop closes.
"""

from __future__ import annotations

import asyncio
import os
import socket

_TICK_S = 1.0


class EventLoopProgress:
    def __init__(self, worker, loop: asyncio.AbstractEventLoop):
        self._worker = worker
        self._loop = loop
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        # A socket whose peer is closed is always readable: awaiting it yields to
        # every other ready callback first, then returns at once.
        self._rsock, wsock = socket.socketpair()
        self._rsock.setblocking(False)
        wsock.close()
        self._task: asyncio.Task | None = None
        self._watching = False
        self._progress_until_armed()
        self._tick = loop.call_later(_TICK_S, self._on_tick)

    def _on_event(self) -> None:
        self._loop.remove_reader(self._fd)
        self._watching = False
        self._progress_until_armed()

    def _on_tick(self) -> None:
        if self._loop.is_closed():
            return
        self._progress_until_armed()
        self._tick = self._loop.call_later(_TICK_S, self._on_tick)

    def _progress_until_armed(self) -> None:
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._arm())

    async def _arm(self) -> None:
        while True:
            self._worker.progress()
            await self._loop.sock_recv(self._rsock, 1)
            if self._worker.arm():
                break
        if not self._watching:
            self._loop.add_reader(self._fd, self._on_event)
            self._watching = True


def ensure_progress(ucxx) -> None:
    """Create ucxx's context if needed, progressed by ``EventLoopProgress`` on the running loop."""
    from ucxx._lib_async import application_context

    tasks = application_context.ProgressTasks
    loop = asyncio.get_running_loop()
    if loop in tasks:
        return
    if os.environ.get("UCXPY_PROGRESS_MODE") != "blocking":
        ucxx.core._get_ctx()  # the operator chose another mode: ucxx progresses by itself
        # In thread mode with Python futures, ucxx's notifier thread is not a daemon
        # and runs until told to stop: without this the interpreter never exits.
        close = loop.close

        def close_and_stop() -> None:
            ucxx.stop_notifier_thread()
            close()

        loop.close = close_and_stop
        return
    tasks[loop] = None  # placeholder: ucxx skips starting its own progress for this loop
    try:
        ctx = ucxx.core._get_ctx()
        tasks[loop] = EventLoopProgress(ctx.worker, loop)
    except BaseException:
        del tasks[loop]
        raise
