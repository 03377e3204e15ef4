"""A process's CPU time and its time runnable but waiting for a CPU, from Linux's ``/proc/<pid>/task/*/schedstat``.

    before = sched_stat.read(pid); ...; after = sched_stat.read(pid)
    sched_stat.delta(before, after)    # {"cpu_s", "runqueue_wait_s"} over the interval, all threads

A loop that wakes late is either busy with its own work (CPU time) or ready
and not scheduled because other processes hold the cores (run-queue wait):
``bench frontdoor`` tells the two apart with this for every process of the
stack. None where the kernel does not expose schedstat (not Linux, or a
process that is gone).
"""

from __future__ import annotations

import os


def read(pid: int, main_thread: bool = False) -> tuple[float, float] | None:
    """(CPU seconds, run-queue wait seconds) of every thread of ``pid`` so far (``main_thread``: of its main
    thread alone, where an asyncio process runs its loop), or None."""
    cpu = wait = 0
    try:
        tasks = [str(pid)] if main_thread else os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        cpu += int(run_ns)
        wait += int(wait_ns)
    return cpu / 1e9, wait / 1e9


def delta(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict | None:
    if before is None or after is None:
        return None
    return {"cpu_s": round(after[0] - before[0], 2), "runqueue_wait_s": round(after[1] - before[1], 2)}
