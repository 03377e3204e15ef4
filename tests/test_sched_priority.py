"""Setting how Linux schedules a process's threads (services/sched_priority.py) and what each process of a
stack gets by default (services/front_first.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from services import front_first, sched_priority

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")

# a process with three threads besides its main one; after "go" on stdin it starts one more and prints its tid
_THREADS = """
import sys, threading, time
[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]
print("up", flush=True)
sys.stdin.readline()
t = threading.Thread(target=time.sleep, args=(30,), daemon=True); t.start(); time.sleep(0.2)
print(t.native_id, flush=True)
time.sleep(30)
"""


@pytest.fixture
def threaded():
    child = subprocess.Popen([sys.executable, "-c", _THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "up"
    yield child
    child.kill()
    child.wait()


def _later_thread(child) -> int:
    child.stdin.write("go\n")
    child.stdin.flush()
    return int(child.stdout.readline())


def _slice(pid: int, tid: int) -> int | None:
    with open(f"/proc/{pid}/task/{tid}/sched") as f:
        return next((int(float(line.split(":")[1])) for line in f if line.startswith("se.slice")), None)


def _custom_slices() -> bool:
    """Whether this kernel shows and honours a thread's own slice (EEVDF's custom slice, Linux 6.12+)."""
    before = sched_priority.slice_ns(os.getpid())
    if before is None:
        return False
    probe = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sched_priority.set_slice(probe.pid, 200_000)
        return sched_priority.slice_ns(probe.pid) == 200_000
    except OSError:
        return False
    finally:
        probe.kill()
        probe.wait()


needs_custom_slices = pytest.mark.skipif(not _custom_slices(), reason="the kernel has no custom slices (Linux < 6.12)")


def test_renice_sets_every_thread_of_a_process(threaded):
    assert sched_priority.renice(threaded.pid, 7) == 4
    assert all(os.getpriority(os.PRIO_PROCESS, int(t)) == 7 for t in os.listdir(f"/proc/{threaded.pid}/task"))
    assert os.getpriority(os.PRIO_PROCESS, _later_thread(threaded)) == 7  # a thread made later inherits it


def test_a_lower_policy_reaches_every_thread_and_later_ones(threaded):  # SCHED_BATCH: an idle one may starve
    assert sched_priority.set_policy(threaded.pid, os.SCHED_BATCH) == 4
    tids = [int(t) for t in os.listdir(f"/proc/{threaded.pid}/task")]
    assert all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in tids)
    assert os.sched_getscheduler(_later_thread(threaded)) == os.SCHED_BATCH


@needs_custom_slices
def test_a_slice_reaches_every_thread_and_later_ones_and_keeps_the_niceness(threaded):
    sched_priority.renice(threaded.pid, 3)
    assert sched_priority.set_slice(threaded.pid, 100_000) == 4
    tids = [int(t) for t in os.listdir(f"/proc/{threaded.pid}/task")]
    assert {_slice(threaded.pid, t) for t in tids} == {100_000}
    assert all(os.getpriority(os.PRIO_PROCESS, t) == 3 and os.sched_getscheduler(t) == os.SCHED_OTHER for t in tids)
    assert _slice(threaded.pid, _later_thread(threaded)) == 100_000


@needs_custom_slices
def test_front_first_gives_the_front_door_short_slices_and_leaves_the_engine_alone(threaded):
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        default = sched_priority.slice_ns(engine.pid)
        assert front_first.apply("decode-0", engine.pid) == []
        assert sched_priority.slice_ns(engine.pid) == default != front_first.FRONT_SLICE_NS
        assert front_first.apply("gateway", threaded.pid) == []
        assert sched_priority.slice_ns(threaded.pid) == front_first.FRONT_SLICE_NS
    finally:
        engine.kill()
        engine.wait()


def test_front_first_on_a_process_that_is_gone_is_not_an_error():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    time.sleep(0.1)
    assert front_first.apply("router", child.pid) == []
