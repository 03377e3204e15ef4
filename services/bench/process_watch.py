"""What a stack's processes hold while a benchmark runs: Redis connections, memory, CPU, sampled at peak.

A thread samples every ``interval_s``: Redis's own ``CLIENT LIST``, counted by
connection name (every pdserve process names its connections
``pdserve-<role>-<pid>``; ``connect_redis``), and, for each watched process,
its resident memory and CPU use (psutil; 100 % = one core busy). It keeps the
peak of each, so a burst's worst moment is reported rather than its average.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from dataclasses import dataclass, field

from services.registry import redis_client_options


def cpu_seconds(procs: dict) -> dict[str, float]:
    """User + system CPU seconds so far of each psutil process by name (0 for one that is gone);
    a bench takes two readings and charges the difference to the work between them."""
    out = {}
    for name, proc in procs.items():
        try:
            t = proc.cpu_times()
            out[name] = t.user + t.system
        except Exception:  # gone: counts nothing more
            out[name] = 0.0
    return out


def wakeups(procs: dict) -> dict[str, int]:
    """Voluntary context switches so far of each psutil process by name, over all its threads (0 for one that is
    gone): each is a thread going to sleep on a wait (a socket, a futex, epoll), so the difference of two
    readings counts the process's wake-ups between them, in the threads alive at both (a thread that exits takes
    its count with it; the stack's threads live as long as their process). psutil's own count is the main
    thread's only."""
    out = {}
    for name, proc in procs.items():
        total = 0
        try:
            for task in os.listdir(f"/proc/{proc.pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/task/{task}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            total += int(line.split()[1])
        except OSError:  # gone (or not Linux): counts nothing more
            pass
        out[name] = total
    return out


@dataclass
class ProcessPeak:
    redis_connections: int = 0
    rss_mib: float = 0.0
    cpu_percent: float = 0.0
    cpu_seconds: float = 0.0  # user + system since the watch started


@dataclass
class Peaks:
    processes: dict[str, ProcessPeak] = field(default_factory=dict)
    other_redis_connections: int = 0  # named by nothing we watch (the bench's own, tools)
    samples: int = 0


class ProcessWatch:
    def __init__(self, redis_url: str, pids: dict[str, int], interval_s: float = 0.25):
        import psutil
        import redis

        self.redis = redis.Redis.from_url(redis_url, **redis_client_options("bench-watch"))
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.names = {pid: name for name, pid in pids.items()}
        self.interval_s = interval_s
        self.peaks = Peaks({name: ProcessPeak() for name in pids})
        self._cpu0 = {name: self._cpu_seconds(p) for name, p in self.procs.items()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _cpu_seconds(proc) -> float:
        times = proc.cpu_times()
        return times.user + times.system

    def connections(self) -> dict[str, int]:
        """Redis connections now, per watched process (by the pid in the connection's name), and 'other'."""
        counts: Counter = Counter()
        for client in self.redis.client_list():
            pid = client.get("name", "").rsplit("-", 1)[-1]
            name = self.names.get(int(pid)) if pid.isdigit() else None
            counts[name or "other"] += 1
        counts["other"] -= 1  # this watch's own connection
        return dict(counts)

    def rss_mib(self, name: str) -> float:
        return self.procs[name].memory_info().rss / 2**20

    def sample(self) -> None:
        counts = self.connections()
        for name, proc in self.procs.items():
            peak = self.peaks.processes[name]
            peak.redis_connections = max(peak.redis_connections, counts.get(name, 0))
            try:
                peak.rss_mib = max(peak.rss_mib, proc.memory_info().rss / 2**20)
                peak.cpu_percent = max(peak.cpu_percent, proc.cpu_percent())  # since the previous sample
                peak.cpu_seconds = self._cpu_seconds(proc) - self._cpu0[name]
            except Exception:  # the process exited: keep what was seen
                continue
        self.peaks.other_redis_connections = max(self.peaks.other_redis_connections, counts.get("other", 0))
        self.peaks.samples += 1

    def _run(self) -> None:
        for proc in self.procs.values():
            proc.cpu_percent()  # the first call only starts psutil's interval
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # Redis busy for a moment: the next sample counts
                continue

    def __enter__(self) -> ProcessWatch:
        self._thread = threading.Thread(target=self._run, daemon=True, name="process-watch")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.sample()
        self.redis.close()
