"""Workers that share one host's cores: while more of them compute than it has cores, each runs slower.

``pdserve bench routing`` runs its two prefill workers and its decode worker (one torch
thread each) on the project's 2-core machine, beside the router, the gateway and
Redis. The calibration times one worker alone on a core, so a simulator that gives
every worker its own core runs that bench's busy moments too fast: when both prefill
workers compute while the decode worker steps, three threads share two cores.

Processor sharing: with ``n`` workers computing on ``cores`` cores each progresses at
``min(1, cores / n)`` of its calibrated speed. When ``n`` changes every computing
worker is settled (its progress so far at the old speed) and re-timed (its next event
at the new speed). The router, gateway and Redis are not modelled (their CPU is small
beside a prefill's, but not zero). ``ClusterConfig.host_cores`` 0 (the default, and
every run of the policy comparison and the autoscaler) gives each worker its own
hardware and leaves those runs as they were.

A decode worker is more than one thread: beside the engine's steps its event loop streams
the tokens out (and takes the KV in), the CPU a served decode worker spends beyond the
engine's (``WorkerProfile.decode_loop_cpu_share``). While it computes it counts as ``1 +
share`` runnable threads: its steps progress at the host's speed and its loop's work, that
share of them, beside them, so it takes cores from the other workers, not time from its own
steps.

The front door (``FrontDoor``): the router, Redis and the client run on those cores too.
``pdserve bench routing`` measures each process's CPU per request from /proc
(``cpu_ms_per_request``); the profile's ``frontdoor_cpu_s`` is their sum per request and
``frontdoor_busy_cores`` what they use whether requests come or not (heartbeats,
registry reads, polls), which the host's cores lose for good. Each
dispatched request hands the front door that much work; while it has work it is one
more runnable thread beside the computing workers (it slows them, and they it). Its
latency on a request's path is not charged here: the profile's hand-off latency
(``transfer.latency_s``, measured under the same load) holds the hops.
"""

from __future__ import annotations

from collections import deque


class SharedHost:
    def __init__(self, cores: float):
        if not cores > 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.cores = cores
        self.computing: list = []  # workers computing now, in the order they started (deterministic)

    def load(self) -> float:
        """Runnable threads: a worker counts its ``threads`` (a decode worker's engine and event loop), else 1."""
        return sum(getattr(w, "threads", 1.0) for w in self.computing)

    def speed(self, load: float | None = None) -> float:
        n = self.load() if load is None else load
        return min(1.0, self.cores / n) if n > 1e-12 else 1.0

    def set_computing(self, worker, computing: bool, now: float) -> None:
        """``worker`` starts or stops computing at ``now``; the others' speeds follow."""
        if computing == (worker in self.computing):
            return
        threads = getattr(worker, "threads", 1.0)
        old, new = self.speed(), self.speed(self.load() + (threads if computing else -threads))
        if old != new:
            for w in self.computing:
                w.settle(now)  # progress so far, at the old speed
        if computing:
            self.computing.append(worker)
        else:
            self.computing.remove(worker)
        worker.speed = new if computing else 1.0
        if old != new:
            for w in self.computing:
                if w is not worker:
                    w.speed = new
                    w.retime(now)


class FrontDoor:
    """The router, Redis and the client as one thread on the shared host: a queue of CPU work in seconds
    (at full speed), done at the host's speed; ``busy_s`` is the work it was given."""

    def __init__(self, loop, host: SharedHost):
        self.loop = loop
        self.host = host
        self.queue: deque[float] = deque()
        self.busy_s = 0.0
        self.speed = 1.0
        self._work = 0.0
        self._since = 0.0
        self._version = 0

    def submit(self, cpu_s: float) -> None:
        if cpu_s <= 0:
            return
        self.busy_s += cpu_s
        self.queue.append(cpu_s)
        if len(self.queue) == 1 and self not in self.host.computing:
            self._start(self.loop.now)

    def _start(self, now: float) -> None:
        self._work, self._since = self.queue[0], now
        if self in self.host.computing:
            self.retime(now)
        else:
            self.host.set_computing(self, True, now)
            self.retime(now)

    def settle(self, now: float) -> None:
        self._work -= (now - self._since) * self.speed
        self._since = now

    def retime(self, now: float) -> None:
        self._version += 1
        self.loop.after(max(0.0, self._work) / self.speed, self._done, self._version)

    def _done(self, version: int) -> None:
        if version != self._version:
            return
        now = self.loop.now
        self.queue.popleft()
        if self.queue:
            self._start(now)
        else:
            self.host.set_computing(self, False, now)
