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
"""

from __future__ import annotations


class SharedHost:
    def __init__(self, cores: int):
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.cores = cores
        self.computing: list = []  # workers computing now, in the order they started (deterministic)

    def speed(self, computing: int | None = None) -> float:
        n = len(self.computing) if computing is None else computing
        return min(1.0, self.cores / n) if n else 1.0

    def set_computing(self, worker, computing: bool, now: float) -> None:
        """``worker`` starts or stops computing at ``now``; the others' speeds follow."""
        if computing == (worker in self.computing):
            return
        old, new = self.speed(), self.speed(len(self.computing) + (1 if computing else -1))
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
