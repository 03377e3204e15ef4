"""``pdserve planner``: the autoscaling planner as a service.

Every ``--interval`` seconds it reads the signals (signals.py: Redis registry and
queue, the workers' Prometheus metrics), asks the planner (policy.py) for prefill,
decode and warm-pool counts, and acts on the decision:

* ``--actuate emit`` (for Kubernetes): prints one JSON line per decision, writes it
  to the Redis hash ``pd:planner:<model>`` and exports it as the gauge
  ``pdserve_planner_desired_replicas{role}`` on ``--metrics-port``: a KEDA
  ``prometheus`` trigger on that gauge with ``threshold: "1"`` makes the
  Deployment's replica count the planner's (docs/autoscaling.md).
* ``--actuate local`` (beside ``pdserve up``): starts ``pdserve prefill`` /
  ``pdserve decode`` processes against the same Redis (``--worker-args`` passes
  their flags, e.g. a small ``--kv-cache-gb``) and drains the ones it started
  (SIGTERM: deregister, finish in-flight work) when the decision falls. It never
  stops workers it did not start. Locally there is no warm pool: a standby worker
  would hold a model's memory on the same few cores; the decision's ``warm`` is
  reported only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time

from services.launcher import Process, _cli
from services.planner.policy import Decision, Planner
from services.planner.signals import SignalReader, Snapshot

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


class EmitActuator:
    """Publishes the decision; something else (KEDA, an operator) changes the replica counts."""

    def __init__(self, redis, model: str, gauge=None, out=sys.stdout):
        self.redis = redis
        self.key = f"pd:planner:{model}"
        self.gauge = gauge
        self.out = out

    async def apply(self, decision: Decision, snap: Snapshot) -> dict:
        return await self.publish(decision, self.record(decision, snap))

    @staticmethod
    def record(decision: Decision, snap: Snapshot) -> dict:
        return {"t": round(time.time(), 3), "prefill": decision.prefill, "decode": decision.decode,
                "warm": decision.warm, "reason": decision.reason,
                "current": {"prefill": snap.signals.prefill_workers, "decode": snap.signals.decode_workers}}

    async def publish(self, decision: Decision, record: dict) -> dict:
        await self.redis.hset(self.key, mapping={"prefill": decision.prefill, "decode": decision.decode,
                                                 "warm": decision.warm, "reason": decision.reason,
                                                 "at": record["t"]})
        if self.gauge is not None:
            for role in ROLES:
                self.gauge.labels(role=role).set(getattr(decision, role))
            self.gauge.labels(role="warm").set(decision.warm)
        print(json.dumps(record), file=self.out, flush=True)
        return record

    def close(self) -> None:
        pass


class LocalActuator(EmitActuator):
    """Also starts and drains local worker processes to match the decision."""

    def __init__(self, redis, model: str, redis_url: str, worker_args: list[str], gauge=None, out=sys.stdout,
                 echo=None):
        super().__init__(redis, model, gauge, out)
        self.redis_url = redis_url
        self.worker_args = worker_args
        self.echo = echo
        self.started: dict[str, list[Process]] = {role: [] for role in ROLES}
        self._n = 0

    async def apply(self, decision: Decision, snap: Snapshot) -> dict:
        record = self.record(decision, snap)
        for role in ROLES:
            mine = self.started[role]
            mine[:] = [p for p in mine if p.alive()]
            # registered workers plus ours still loading: what the decision is compared with
            starting = sum(1 for p in mine if not p.ready.is_set())
            have = getattr(snap.signals, f"{role}_workers") + starting
            want = getattr(decision, role)
            for _ in range(max(0, want - have)):
                self._n += 1
                p = Process(f"planner-{role}-{self._n}", _cli(role, "--redis-url", self.redis_url,
                                                             *self.worker_args), self.echo)
                p.start()
                mine.append(p)
            for p in reversed(mine[-max(0, have - want):] if have > want else []):
                p.signal(signal.SIGTERM)  # drains: deregisters at once, finishes its in-flight work
                mine.remove(p)
            record[f"local_{role}"] = len(mine)
        return await self.publish(decision, record)

    def close(self) -> None:
        for role in ROLES:
            for p in self.started[role]:
                p.signal(signal.SIGTERM)
            for p in self.started[role]:
                if p.proc is not None:
                    try:
                        p.proc.wait(30)
                    except subprocess.TimeoutExpired:
                        p.signal(signal.SIGKILL)


async def run_loop(reader: SignalReader, planner: Planner, actuator, interval_s: float, ticks: int = 0,
                   stopping: asyncio.Event | None = None, forecast_path: str | None = None) -> list[dict]:
    """Tick until ``stopping`` is set (or ``ticks`` ticks, when > 0); the records of every tick. With the
    planner's forecast, each tick's demand is recorded in it (and saved to ``forecast_path``)."""
    stopping = stopping or asyncio.Event()
    records = []
    while not stopping.is_set():
        snap = await reader.read()
        records.append(await actuator.apply(planner.decide(snap.signals), snap))
        if planner.forecast is not None:
            s = snap.signals
            planner.forecast.record(s.now, (s.prefill_tokens_per_s, float(s.kv_blocks_used), float(s.running_seqs)))
            if forecast_path:
                await asyncio.to_thread(planner.forecast.save, forecast_path)
        if ticks and len(records) >= ticks:
            break
        try:
            await asyncio.wait_for(stopping.wait(), interval_s)
        except TimeoutError:
            pass
    return records
