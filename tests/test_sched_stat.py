"""Per-process CPU and run-queue wait (services/sched_stat.py) and event-loop lag (services/loop_lag.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from services import sched_stat
from services.loop_lag import LoopLag

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")


def test_cpu_time_counts_work_done_between_two_reads():
    before = sched_stat.read(os.getpid(), main_thread=True)
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of CPU on this thread
        pass
    got = sched_stat.delta(before, sched_stat.read(os.getpid(), main_thread=True))
    assert got is not None and got["cpu_s"] >= 0.15 and got["runqueue_wait_s"] >= 0


def test_a_process_that_is_gone_reads_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert sched_stat.read(child.pid) is None and sched_stat.delta(None, (1.0, 0.0)) is None


def test_a_blocked_loop_shows_as_lag():
    async def run() -> LoopLag:
        lag = LoopLag(interval_s=0.005).start()
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # a callback that holds the loop
        await asyncio.sleep(0.05)
        lag.stop()
        return lag

    lag = asyncio.run(run())
    assert max(late for _, late in lag.samples) >= 250
