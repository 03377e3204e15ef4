"""Autoscalers driving the simulated cluster: the planner (services/planner), an HPA-like
threshold rule, or nothing (static provisioning), with cold starts, a warm pool and
worker-hours accounted.

Every ``interval_s`` the controller reads the cluster's signals (the ones ``pdserve
planner`` reads from Redis and Prometheus), decides, and acts: a scale-up takes a warm
standby first (``warm_start_s``), else starts a worker cold (``cold_start_s``); a
scale-down drains the least loaded workers (they deregister at once and leave when
idle), and a drained worker refills the warm pool if it is short (its model is still
loaded; with the planner's ``standby_hold_s`` it parks there always, and loaded standbys
over the pool's target are let go once they stood over it that long). A pool still short
starts standbys cold: they join it ``cold_start_s`` later. ``pool_events`` counts them: starts
from the pool and cold, standby loads, loads cancelled, standbys released, workers parked.
Worker-hours count every worker that holds a machine: starting, serving, draining, warm
standby and standby still loading; ``breakdown`` splits them by state (per role for the
workers that hold one), so a run's overspend can be read against the ideal curve.
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
                 planner_config: PlannerConfig | None = None, threshold: float = 0.7,
                 threshold_window_s: float = 300.0, forecast=None):
        if kind not in ("planner", "threshold"):
            raise ValueError(f"unknown autoscaler {kind!r}")
        self.kind = kind
        self.profile = profile
        self.slo = slo
        self.interval_s = interval_s
        self.planner = Planner(planner_config or PlannerConfig(), capacity_of(profile), forecast)
        self.rule = ThresholdRule(target=threshold, down_after_s=threshold_window_s)
        self.warm = 0  # standbys ready (model loaded, not registered)
        self._warming: list[float] = []  # standbys still loading: when each is ready
        self.warm_target = self.planner.config.warm_min if kind == "planner" else 0
        self.hold_s = self.planner.config.standby_hold_s if kind == "planner" else 0.0
        self._surplus_since: float | None = None  # since when loaded standbys stood over the pool's target
        self.worker_seconds = 0.0
        # worker-seconds by state: "<role> serving|starting|draining", "warm", "warming"
        self.breakdown: dict[str, float] = {}
        self._last = 0.0
        self._last_tick = -1e9
        self._window: list = []
        self._computed = 0
        self._busy = {"prefill": 0.0, "decode": 0.0}
        self.decisions: list[dict] = []
        # how workers came and went (pool_events): "warm" / "cold" starts of serving workers, "standby" cold starts into the
        # pool, "standby cancelled" (released still loading: its load time spent for nothing) and "standby
        # released" (a loaded one let go), "parked" (a drained worker kept in the pool)
        self.pool_events: dict[str, int] = {}

    def attach(self, sim) -> None:
        sim.controller = self
        sim.on_finished = self._window.append

    def retired(self, sim, worker) -> None:
        self._account(sim)
        if self.hold_s or self.warm + len(self._warming) < self.warm_target:
            self.warm += 1  # parked: model still loaded, deregistered
            self._count("parked")

    def _account(self, sim) -> None:
        now = sim.loop.now
        dt = now - self._last
        self.worker_seconds += dt * (len(sim.workers) + self.warm + len(self._warming))
        if dt > 0:
            b = self.breakdown
            for w in sim.workers.values():
                state = "draining" if w.draining else "starting" if w.ready_at > self._last else "serving"
                key = f"{w.role} {state}"
                b[key] = b.get(key, 0.0) + dt
            b["warm"] = b.get("warm", 0.0) + dt * self.warm
            b["warming"] = b.get("warming", 0.0) + dt * len(self._warming)
        self._last = now
        ready = [t for t in self._warming if t <= now]
        if ready:
            self.warm += len(ready)
            self._warming = [t for t in self._warming if t > now]

    def tick(self, sim) -> None:
        self._account(sim)
        now = sim.loop.now
        if now - self._last_tick < self.interval_s:
            return
        window_s = min(now - self._last_tick, now) or self.interval_s
        self._last_tick = now
        jobs = self._window[:]  # the list itself stays: the cluster appends to it
        self._window.clear()
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
                # dispatched, unfinished requests count as traffic: one waiting for a worker of a model
                # scaled to zero is in neither the queue nor a batch
                requests_in_window=len(jobs) + len(sim.admission) + sim.inflight, judged_requests=len(jobs),
                prefill_starting=sum(w.ready_at > now for w in active["prefill"]),
                decode_starting=sum(w.ready_at > now for w in active["decode"]))
            d = self.planner.decide(signals)
            targets, self.warm_target = {"prefill": d.prefill, "decode": d.decode}, d.warm
            reason = d.reason
        else:
            reason = "utilisation"
            targets = {}
            for role in ("prefill", "decode"):
                busy = sum(w.busy_s for w in list(sim.workers.values()) + sim.retired if w.role == role)
                util = (busy - self._busy[role]) / (window_s * max(len(active[role]), 1))
                self._busy[role] = busy
                targets[role] = self.rule.desired(role, now, len(active[role]), min(util, 1.0))
        for role, target in targets.items():
            self._scale(sim, role, active[role], target)
        while self.warm + len(self._warming) < self.warm_target:  # refill the pool: cold starts that end parked
            self._warming.append(now + self.profile.cold_start_s)
            self._count("standby")
        extra = self.warm + len(self._warming) - self.warm_target
        surplus = 0
        if extra > 0:  # release the surplus, the still-loading first
            drop = min(extra, len(self._warming))
            self._warming = self._warming[: len(self._warming) - drop]
            self._count("standby cancelled", drop)
            surplus = extra - drop
        # the loaded ones once they stood over the target for hold_s (at once without a hold)
        if not surplus:
            self._surplus_since = None
        else:
            self._surplus_since = now if self._surplus_since is None else self._surplus_since
            if now - self._surplus_since >= self.hold_s:
                self.warm -= surplus
                self._count("standby released", surplus)
                self._surplus_since = None
        self.decisions.append({"t": round(now, 1), **targets, "warm": self.warm, "warming": len(self._warming),
                               "reason": reason})

    def _count(self, what: str, n: int = 1) -> None:
        if n:
            self.pool_events[what] = self.pool_events.get(what, 0) + n

    def _scale(self, sim, role: str, active: list, target: int) -> None:
        if target > len(active):
            for _ in range(target - len(active)):
                if self.warm > 0:
                    self.warm -= 1
                    sim.add_worker(role, ready_in=self.profile.warm_start_s)
                    self._count("warm")
                else:
                    sim.add_worker(role, ready_in=self.profile.cold_start_s)
                    self._count("cold")
        elif target < len(active):
            def load(w):
                return (len(w.queue) + (w.running is not None)) if role == "prefill" else w.blocks_used
            for w in sorted(active, key=lambda w: (load(w), w.worker_id))[: len(active) - target]:
                sim.drain(w)
