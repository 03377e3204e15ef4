"""Setting how Linux schedules a process's threads: the knobs behind ``pdserve up``'s front-door-first default.

    sched_priority.set_slice(pid, 100_000)      # every thread asks for 0.1 ms slices (EEVDF; no privilege)
    sched_priority.set_policy(pid, os.SCHED_IDLE)
    sched_priority.set_autogroup_nice(pid, 19)  # the share of the session's task group (autogroup)
    sched_priority.renice(pid, 10); sched_priority.realtime(pid)

Each applies to every thread the process has now (Linux schedules threads, and
most of these calls set one thread); threads and processes made later inherit
their creator's setting. Each raises OSError where the kernel refuses
(EPERM: a privilege is needed; EINVAL: an older kernel); the caller decides
what a refusal means.

Why the slice: since Linux 6.6 the fair class is EEVDF, which orders ready
threads by a virtual deadline of *when they were woken + their slice*, and
since 6.12 a thread may ask for its own slice (``sched_setattr``'s
``sched_runtime``, 0.1-100 ms, no privilege: it changes when a thread runs,
not how much CPU it gets) and a woken thread with a shorter slice preempts a
running one with a longer slice (PREEMPT_SHORT). A light process that asks
for 0.1 ms slices therefore gets a core soon after it wakes even when engine
threads keep every core busy, without taking any CPU share from them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import time

_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(platform.machine())


class _SchedAttr(ctypes.Structure):  # include/uapi/linux/sched/types.h (SCHED_ATTR_SIZE_VER1)
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def set_slice(pid: int, slice_ns: int) -> int:
    """Every thread of ``pid`` asks for ``slice_ns`` slices (its policy and niceness kept). Returns the threads set."""
    if _SYS_SCHED_SETATTR is None:
        raise OSError(errno.ENOSYS, f"sched_setattr: unknown system call number on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)

    def one(tid: int) -> None:
        attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=os.sched_getscheduler(tid),
                          sched_nice=os.getpriority(os.PRIO_PROCESS, tid), sched_runtime=slice_ns)
        if libc.syscall(_SYS_SCHED_SETATTR, tid, ctypes.byref(attr), 0) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"sched_setattr(sched_runtime={slice_ns}): {os.strerror(code)}")

    return _each_thread(pid, one)


def slice_ns(pid: int) -> int | None:
    """The slice ``pid``'s main thread runs with (``se.slice`` in ``/proc/<pid>/sched``), or None where not shown."""
    try:
        with open(f"/proc/{pid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(float(line.split(":")[1]))
    except (OSError, ValueError):
        pass
    return None


def set_policy(pid: int, policy: int) -> int:
    """Every thread of ``pid`` in ``policy`` (os.SCHED_OTHER / SCHED_BATCH / SCHED_IDLE: lowering needs no
    privilege). Returns the threads set."""
    return _each_thread(pid, lambda tid: os.sched_setscheduler(tid, policy, os.sched_param(0)))


def set_autogroup_nice(pid: int, niceness: int) -> bool:
    """The niceness of ``pid``'s autogroup: with ``kernel.sched_autogroup_enabled`` each session (and ``pdserve
    up`` starts every child in a session of its own) is a task group that shares the cores with the others as
    one, whatever its threads' own niceness. False where autogroups are off or the process is in a cgroup of
    its own (then they do not apply). A niceness below 0 needs CAP_SYS_NICE; an unprivileged caller may set an
    autogroup once per 0.1 s, so this retries."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() != "1":
                return False
        with open(f"/proc/{pid}/autogroup") as f:
            if not f.read().startswith("/autogroup-"):
                return False
    except OSError:
        return False
    for _ in range(20):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(niceness))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise
            time.sleep(0.11)
    raise OSError(errno.EAGAIN, f"autogroup of {pid}: busy")


def renice(pid: int, niceness: int) -> int:
    """Set the niceness of every thread of ``pid`` (Linux's setpriority applies to one thread). Returns how
    many threads were set."""
    return _each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, niceness))


def realtime(pid: int, priority: int = 1) -> int:
    """Put every thread of ``pid`` in the round-robin real-time class (``SCHED_RR``): it runs whenever it is
    ready, before every ordinary process (Linux keeps 5% of each second for those). Needs root."""
    return _each_thread(pid, lambda tid: os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(priority)))


def _each_thread(pid: int, apply) -> int:
    done = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    for tid in tids:
        try:
            apply(int(tid))
            done += 1
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
    return done
