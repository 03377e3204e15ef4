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
descriptor again. Idle cost measured here: 0.0006 s of CPU in 3 s. A slow
tick progresses the worker in case a wake-up was ever missed, as ucxx's own
mode does.

Two things the descriptor alone does not cover, both needed by ``ucx.py``:

- **Work that is not an event.** Single-copy transports (cma) are driven by
  progress calls, not by a descriptor: a receive posted for a rendezvous
  message that already arrived starts its copy at once and then only moves
  when the worker is progressed. Without ``kick()`` after posting it, it
  waited for the next tick (measured: 0.06 GB/s, four 47 MB chunks at about
  one tick each). ``worker.progress()`` loops until nothing moves, so one
  kick runs such a copy to its end.
- **Waiting without spinning.** An awaited ucxx request in this mode polls
  (``await asyncio.sleep(0)`` until done): the process waiting for its peer
  burns a core, which on a 2-core host is the core the peer copies with
  (a 2 s wait cost 1.25 s of CPU here). ``wait(done)`` resolves a future from
  the progress loop instead, since requests complete only inside progress
  calls; a short tick while anything waits covers completions made by
  progress calls elsewhere (ucxx's own, endpoint aborts).

It is installed per event loop before ucxx creates its context or its own
progress task, through ucxx's per-loop registry ``ProgressTasks`` (a
private name of ucxx 0.52: pin the minor version).

With ``UCXPY_PROGRESS_MODE=thread`` (and ``UCXPY_ENABLE_PYTHON_FUTURE=1``,
without which each awaited request is polled from the event loop while the
progress thread holds the GIL) ucxx progresses on its own thread; ``wait``
then polls, and the only other thing done here is stopping its notifier
thread when the loop closes.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

_TICK_S = 1.0  # idle: progress once a second in case a wake-up was missed
_WAITING_TICK_S = 0.02  # something waits: check completions this often regardless


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
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future]] = []
        self._progress_until_armed()
        self._tick = loop.call_later(_TICK_S, self._on_tick)

    def kick(self) -> None:
        """Progress soon, even if the descriptor stays quiet (work was just posted)."""
        self._progress_until_armed()

    def wait(self, done: Callable[[], bool]) -> asyncio.Future:
        """A future resolved (from the progress loop) once ``done()`` is true."""
        fut = self._loop.create_future()
        self._waiters.append((done, fut))
        self.settle()
        self.kick()
        if len(self._waiters) == 1:
            self._tick.cancel()
            self._tick = self._loop.call_later(_WAITING_TICK_S, self._on_tick)
        return fut

    def settle(self) -> None:
        """Resolve the waiters whose condition holds (completions happen in progress calls)."""
        if not self._waiters:
            return
        pending = []
        for done, fut in self._waiters:
            if fut.done():
                continue  # cancelled by its awaiter
            try:
                if done():
                    fut.set_result(None)
                    continue
            except Exception as e:  # noqa: BLE001 - handed to the awaiter
                fut.set_exception(e)
                continue
            pending.append((done, fut))
        self._waiters = pending

    def _on_event(self) -> None:
        self._loop.remove_reader(self._fd)
        self._watching = False
        self._progress_until_armed()

    def _on_tick(self) -> None:
        if self._loop.is_closed():
            return
        self._progress_until_armed()
        self._tick = self._loop.call_later(_WAITING_TICK_S if self._waiters else _TICK_S, self._on_tick)

    def _progress_until_armed(self) -> None:
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._arm())

    async def _arm(self) -> None:
        while True:
            self._worker.progress()
            self.settle()
            await self._loop.sock_recv(self._rsock, 1)
            if self._worker.arm():
                break
        self.settle()  # a progress call elsewhere may have completed something meanwhile
        if not self._watching:
            self._loop.add_reader(self._fd, self._on_event)
            self._watching = True


class _Polling:
    """``wait`` where ucxx progresses by itself (thread mode): poll the condition."""

    def kick(self) -> None:
        pass

    async def _poll(self, done: Callable[[], bool]) -> None:
        while not done():
            await asyncio.sleep(0.0005)

    def wait(self, done: Callable[[], bool]) -> asyncio.Future:
        return asyncio.ensure_future(self._poll(done))

    def settle(self) -> None:
        pass


def progress_driver() -> EventLoopProgress | _Polling:
    """What progresses UCX on the running loop (``ensure_progress`` must have run)."""
    from ucxx._lib_async import application_context

    progress = application_context.ProgressTasks.get(asyncio.get_running_loop())
    return progress if isinstance(progress, EventLoopProgress) else _Polling()


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
