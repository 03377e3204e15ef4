"""Autoscalers driving the simulated cluster: the planner (services/planner), an HPA-like
threshold rule, or nothing (static provisioning), with cold starts, a warm pool and
worker-hours accounted.

Every ``interval_s`` the controller reads the cluster's signals (the ones ``pdserve
planner`` reads from Redis and Prometheus), decides, and acts: a scale-up takes a warm
standby first (``warm_start_s``), else starts a worker cold (``cold_start_s``); a
scale-down drains the least loaded workers (they deregister at once and leave when
idle), and a drained worker refills the warm pool if it is short. Worker-hours count
every worker that holds a machine: starting, serving, draining and warm standby.
"""

from __future__ import annotations

from services.planner.policy import (
    Capacity,
    Planner,
    PlannerConfig,
    Signals,
    ThresholdRule,
)
from services.sim.metrics import SLO, itl, ttft
from services.sim.profiles import WorkerProfile


def capacity_of(profile: WorkerProfile) -> Capacity:
    # a prompt of 2k tokens with no cache hit: what a prefill worker sustains
    return Capacity(prefill_tokens_per_s=2048 / profile.prefill_s(2048, 2048), kv_blocks=profile.kv_blocks,
                    max_num_seqs=profile.max_num_seqs)


class SimAutoscaler:
    def __init__(self, kind: str, profile: WorkerProfile, slo: SLO, interval_s: float = 10.0,
                 planner_config: PlannerConfig | None = None, threshold: float = 0.7):
        if kind not in ("planner", "threshold"):
            raise ValueError(f"unknown autoscaler {kind!r}")
        self.kind = kind
        self.profile = profile
        self.slo = slo
        self.interval_s = interval_s
        self.planner = Planner(planner_config or PlannerConfig(), capacity_of(profile))
        self.rule = ThresholdRule(target=threshold)
        self.warm = 0
        self.warm_target = self.planner.config.warm_min if kind == "planner" else 0
        self.worker_seconds = 0.0
        self._last = 0.0
        self._last_tick = -1e9
        self._window: list = []
        self._computed = 0
        self._busy = {"prefill": 0.0, "decode": 0.0}
        self.decisions: list[dict] = []

    def attach(self, sim) -> None:
        sim.controller = self
        sim.on_finished = self._window.append

    def retired(self, sim, worker) -> None:
        if self.warm < self.warm_target:
            self.warm += 1  # parked: model still loaded, deregistered

    def _account(self, sim) -> None:
        now = sim.loop.now
        self.worker_seconds += (now - self._last) * (len(sim.workers) + self.warm)
        self._last = now

    def tick(self, sim) -> None:
        self._account(sim)
        now = sim.loop.now
        if now - self._last_tick < self.interval_s:
            return
        window_s = min(now - self._last_tick, now) or self.interval_s
        self._last_tick = now
        jobs, self._window = self._window, []
        active = {role: [w for w in sim.workers.values() if w.role == role and not w.draining]
                  for role in ("prefill", "decode")}
        if self.kind == "planner":
            computed = sim.computed_tokens - self._computed
            self._computed = sim.computed_tokens
            decode = [w for w in active["decode"] if w.ready_at <= now]
            signals = Signals(
                now=now, prefill_workers=len(active["prefill"]), decode_workers=len(active["decode"]),
                prefill_tokens_per_s=computed / window_s,
                queued_prefill_tokens=sim.queued_tokens + sum(w.queued_tokens for w in active["prefill"]),
                kv_blocks_used=sum(w.blocks_used for w in decode),
                running_seqs=sum(len(w.batch) + len(w.waiting) for w in decode),
                ttft_attainment=sum(ttft(j) <= self.slo.ttft_s for j in jobs) / len(jobs) if jobs else None,
                itl_attainment=sum(itl(j) <= self.slo.itl_s for j in jobs) / len(jobs) if jobs else None,
                requests_in_window=len(jobs) + len(sim.admission))
            d = self.planner.decide(signals)
            targets, self.warm_target = {"prefill": d.prefill, "decode": d.decode}, d.warm
        else:
            targets = {}
            for role in ("prefill", "decode"):
                busy = sum(w.busy_s for w in list(sim.workers.values()) + sim.retired if w.role == role)
                util = (busy - self._busy[role]) / (window_s * max(len(active[role]), 1))
                self._busy[role] = busy
                targets[role] = self.rule.desired(role, now, len(active[role]), min(util, 1.0))
        for role, target in targets.items():
            self._scale(sim, role, active[role], target)
        while self.warm < self.warm_target:  # refill the pool: cold starts that end parked
            self.warm += 1
            self.worker_seconds += self.profile.cold_start_s  # held while loading
        self.warm = min(self.warm, max(self.warm_target, 0))
        self.decisions.append({"t": round(now, 1), **targets, "warm": self.warm})

    def _scale(self, sim, role: str, active: list, target: int) -> None:
        if target > len(active):
            for _ in range(target - len(active)):
                if self.warm > 0:
                    self.warm -= 1
                    sim.add_worker(role, ready_in=self.profile.warm_start_s)
                else:
                    sim.add_worker(role, ready_in=self.profile.cold_start_s)
        elif target < len(active):
            def load(w):
                return (len(w.queue) + (w.running is not None)) if role == "prefill" else w.blocks_used
            for w in sorted(active, key=lambda w: (load(w), w.worker_id))[: len(active) - target]:
                sim.drain(w)
