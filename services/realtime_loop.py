"""The gateway's event-loop thread in Linux's real-time class while it behaves like a front door.

    guard = RealtimeLoop(loop)       # in the loop's thread (the main thread: signals land there)
    refused = guard.start()          # None: on; else one line saying why not (the process runs as before)

Why: on a machine whose cores the engine keeps busy, the gateway wakes for a
fraction of a millisecond per chunk and then waits for a core. ``pdserve bench
frontdoor`` measured the gateway runnable-but-waiting for 7-9 s of each minute
at 1,000 open streams even with the engine workers' autogroup at nice 19, and
those waits were the slowest 1% of the chunks (added p99 16.8-20.6 ms). With
the loop thread in ``SCHED_RR`` the wait was 0.01-0.3 s and the p99 4.1-6.5 ms
in five runs (BENCHMARKS.md). A real-time thread runs as soon as it is ready,
ahead of every ordinary thread; it takes no more CPU than it uses (about 14%
of a core there).

What keeps it safe:

- **Only the loop thread.** ``SCHED_RESET_ON_FORK``: threads and processes it
  starts later (a tokenizer pool, exporters) are ordinary.
- **Only while it keeps waiting.** ``RLIMIT_RTTIME`` (``budget_s``, 0.5 s): a
  real-time thread that runs that long without blocking (a burst that keeps the
  loop busy, a bug that spins) gets ``SIGXCPU``, and the handler puts it back
  in the ordinary class at once, then tries real time again ``pause_s`` later.
  Linux also keeps 5% of every second for ordinary threads whatever the
  real-time ones do (``kernel.sched_rt_runtime_us``).
- **Only where allowed.** It needs ``CAP_SYS_NICE`` (root, or a container
  granted it) and a real-time budget in its cgroup; where refused, ``start``
  says why in one line and nothing changes.

``pdserve up`` turns it on for its gateway (``--no-realtime-gateway`` keeps it
off); ``pdserve gateway --realtime`` on its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import time

log = logging.getLogger(__name__)

PRIORITY = 1  # the lowest real-time priority: above every ordinary thread, below the kernel's own
BUDGET_S = 0.5  # CPU seconds the loop may run without blocking before it is ordinary again
LOG_EVERY_S = 60.0  # a burst that keeps the loop busy demotes it every 2.5 s: said once a minute
PAUSE_S = 2.0  # seconds it stays ordinary after that (then real time again; if still busy, ordinary again 0.5 s later)


class RealtimeLoop:
    def __init__(self, loop: asyncio.AbstractEventLoop, priority: int = PRIORITY, budget_s: float = BUDGET_S,
                 pause_s: float = PAUSE_S):
        self.loop = loop
        self.priority = priority
        self.budget_s = budget_s
        self.pause_s = pause_s
        self.demotions = 0  # times the budget ran out (tests and the log read it)
        self.on = False
        self._said = (-LOG_EVERY_S, 0)  # (when the log last said so, demotions then): a line a minute at most

    def start(self) -> str | None:
        """Real time for the calling thread (the loop's); None when on, else why not."""
        if not hasattr(resource, "RLIMIT_RTTIME") or not hasattr(os, "SCHED_RESET_ON_FORK"):
            return "real-time scheduling not applied (not Linux)"
        signal.signal(signal.SIGXCPU, self._over_budget)
        return self._promote()

    def _promote(self) -> str | None:
        try:
            _, hard = resource.getrlimit(resource.RLIMIT_RTTIME)
            budget_us = int(self.budget_s * 1e6)
            # the kernel raises the soft limit by 1 s each time it sends SIGXCPU: set it again every time
            resource.setrlimit(resource.RLIMIT_RTTIME,
                               (budget_us if hard == resource.RLIM_INFINITY else min(budget_us, hard), hard))
            os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(self.priority))
            # the kernel counts CPU without waiting from the thread's last wake-up as a real-time thread, and a
            # demoted loop that is busy again has not woken since: without this nap the old count (past the
            # budget) put it back to ordinary at the next tick
            time.sleep(0.0001)
        except OSError as exc:
            return (f"real-time scheduling not applied ({exc.strerror or exc}: it needs CAP_SYS_NICE and a "
                    "real-time budget in the process's cgroup)")
        self.on = True
        return None

    def _over_budget(self, _signum, _frame) -> None:
        # a signal handler, in the loop's thread between two bytecodes: the scheduling change now, the rest
        # (logging takes locks the interrupted code may hold) on the loop
        if not self.on:
            return
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        self.on = False
        self.demotions += 1
        self.loop.call_soon_threadsafe(self._demoted)

    def _demoted(self) -> None:
        now = time.monotonic()
        if now - self._said[0] >= LOG_EVERY_S:
            times = self.demotions - self._said[1]
            log.warning("the event loop ran %.1f s of CPU without waiting%s: ordinary scheduling for %g s each time",
                        self.budget_s, f" ({times} times in the last minute)" if times > 1 else "", self.pause_s)
            self._said = (now, self.demotions)
        self.loop.call_later(self.pause_s, self._again)

    def _again(self) -> None:
        refused = self._promote()
        if refused:
            log.warning("%s", refused)
