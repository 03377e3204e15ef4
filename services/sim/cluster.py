"""The simulated cluster: the router's real code over modelled workers, in virtual time.

What runs unchanged from production: the routing policies (``router/policy.py``),
one dispatch attempt's decisions (``router/placement.py``: decode choice, prefill
choice, conditional disaggregation, the index's prediction, in-flight counts),
the worker registry view (``router/worker_pool.py``, its clock the virtual one,
fed heartbeat snapshots every ``heartbeat_s``), the prefix index
(``router/prefix_index.py``, fed the workers' KV events) and the admission
queue's weighted-fair dequeue (``queue/scripts.py`` DEQUEUE, see admission.py).

What is modelled: the workers (workers.py, costs from profiles.py), the
transports (a KV transfer is a delay), and the Dispatcher's waiting: a request
with no room on the decode worker it chose waits and retries with the
Dispatcher's backoff (20 ms doubling to 0.5 s), on the same stale view a real
router has until the next heartbeat; one sent to a worker that deregistered since
(drained or gone) is refused, and the Dispatcher marks that worker failed and
tries again at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from services.errors import CapacityError, NoWorkerError
from services.queue.config import QueueConfig
from services.router.placement import begin_decode, begin_prefill, place
from services.router.policy import RouterPolicyConfig, policy_from_config
from services.router.prefix_index import PrefixIndex
from services.router.worker_pool import WorkerPool
from services.router.worker_pool import log as worker_pool_log
from services.sim.admission import SimAdmission
from services.sim.events import EventLoop, collector_paused
from services.sim.host import FrontDoor, SharedHost
from services.sim.prefill_steps import SteppedPrefillWorker
from services.sim.profiles import WorkerProfile
from services.sim.workers import DecodeWorker, Job, PrefillWorker, SimWorker
from services.sim.workloads import SimRequest


@dataclass
class ClusterConfig:
    profile: WorkerProfile
    prefill_workers: int = 1
    decode_workers: int = 1
    policy: str = "kv-aware"
    policy_options: dict = field(default_factory=dict)
    disaggregation: str = "auto"  # auto | always | never, as the router's --disaggregation
    heartbeat_s: float = 1.0
    max_inflight: int = 0  # the router's --max-inflight over all routers; 0: no limit
    closed_loop: int = 0  # >0: requests in flight at once (arrival times ignored), as bench routing sends them
    host_cores: int = 0  # >0: every worker shares one host of this many cores (host.py); 0: each has its own
    sample_s: float = 10.0  # time series resolution
    max_model_len: int = 131_072
    model: str = "model"
    queue: QueueConfig = field(default_factory=QueueConfig)
    # the prefill workers' spill tier (a worker's --kv-spill-gb, in blocks; 0: none): blocks evicted from the KV
    # pool move there, and a prompt that hits them copies them back at spill_restore_bytes_per_s (host memory
    # to the device) instead of computing them. Modelled for the one-prompt-at-a-time prefill worker (GPU profiles)
    prefill_spill_blocks: int = 0
    spill_restore_bytes_per_s: float = 25e9  # PCIe Gen5 x16 at about half its 64 GB/s

    def __post_init__(self) -> None:
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("worker counts must be >= 0")
        if self.disaggregation not in ("auto", "always", "never"):
            raise ValueError(f"disaggregation must be auto, always or never; got {self.disaggregation!r}")
        if self.host_cores < 0:
            raise ValueError("host_cores must be >= 0 (0: every worker has its own hardware)")
        if not self.heartbeat_s > 0 or not self.sample_s > 0:
            raise ValueError("heartbeat_s and sample_s must be > 0")
        if self.prefill_spill_blocks < 0 or not self.spill_restore_bytes_per_s > 0:
            raise ValueError("prefill_spill_blocks must be >= 0 and spill_restore_bytes_per_s > 0")
        if self.prefill_spill_blocks and self.profile.prefill_step_tokens:
            raise ValueError(f"a spill tier is modelled for the one-prompt-at-a-time prefill worker, not the "
                             f"{self.profile.name} profile's stepped one")


class ClusterSim:
    """One run: ``ClusterSim(config, requests).run()`` -> the finished jobs and time series."""

    def __init__(self, config: ClusterConfig, requests: list[SimRequest], controller=None):
        self.config = config
        self.loop = EventLoop()
        self.index = PrefixIndex()
        self.pool = WorkerPool(None, refresh_s=config.heartbeat_s, clock=self.loop.clock,
                               on_removed=self.index.drop_worker)
        self.policy_config = RouterPolicyConfig(policy=config.policy, **config.policy_options)
        self.policy = policy_from_config(self.policy_config)
        self.admission = SimAdmission(config.queue)
        self.requests = requests
        self.workers: dict[str, SimWorker] = {}
        self.retired: list[SimWorker] = []
        self.jobs: list[Job] = []
        self.inflight = 0
        self.computed_tokens = 0  # prompt tokens prefilled (not cache hits), cumulative: the planner's demand
        self.queued_tokens = 0  # prompt tokens of requests in the admission queue
        self._waiting: list[Job] = []  # no room anywhere: retried at their backoff
        self._next_request = 0
        self._ids = {"prefill": 0, "decode": 0}
        self.series: list[dict] = []
        self._last_sample = -math.inf
        self.controller = controller  # an autoscaler with .tick(sim), called every heartbeat
        # the profile's front door uses a steady share of a shared host's cores (host.py)
        self.host = SharedHost(config.host_cores - config.profile.frontdoor_busy_cores) if config.host_cores else None
        # the router, Redis and the client on the same cores (host.py), where the profile measured them
        self.front = FrontDoor(self.loop, self.host) if self.host and config.profile.frontdoor_cpu_s else None
        self.on_finished: Callable[[Job], None] | None = None
        for _ in range(config.prefill_workers):
            self.add_worker("prefill", announce=False)
        for _ in range(config.decode_workers):
            self.add_worker("decode", announce=False)
        self.pool.update([w.heartbeat(0.0) for w in self.workers.values()])  # one update, not one per worker

    # ---- workers ------------------------------------------------------------------------
    def add_worker(self, role: str, ready_in: float = 0.0, announce: bool = True) -> SimWorker:
        """Start a worker; it registers after ``ready_in`` seconds (a cold or warm start). ``announce``:
        a ready worker's heartbeat reaches the router at once (False: at the caller's next update)."""
        self._ids[role] += 1
        if role == "prefill":
            cls = SteppedPrefillWorker if self.config.profile.prefill_step_tokens else PrefillWorker
        else:
            cls = DecodeWorker
        worker = cls(self, f"{role}-{self._ids[role]:04d}", self.config.profile, self.config.model,
                     self.config.max_model_len)
        worker.started_at = self.loop.now
        worker.ready_at = self.loop.now + ready_in
        self.workers[worker.worker_id] = worker
        if ready_in <= 0 and announce:
            self.pool.update([w.heartbeat(self.loop.now) for w in self._registered()])
        return worker

    def _registered(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.ready_at <= self.loop.now]

    def drain(self, worker: SimWorker) -> None:
        """Stop sending it work (it deregisters at once, as a draining worker does); it leaves when idle."""
        worker.draining = True
        self._maybe_retire(worker)

    def _maybe_retire(self, worker: SimWorker) -> None:
        if worker.draining and worker.idle() and worker.worker_id in self.workers:
            del self.workers[worker.worker_id]
            worker.retired_at = self.loop.now
            self.retired.append(worker)
            if self.controller is not None:
                self.controller.retired(self, worker)

    def kv_events(self, worker_id: str, runs) -> None:
        self.index.apply(worker_id, runs)

    # ---- requests -----------------------------------------------------------------------
    def run(self, until: float = float("inf")) -> ClusterSim:
        with collector_paused():  # the day's arrivals are scheduled at once: a heap entry each
            if self.config.closed_loop:
                for _ in range(min(self.config.closed_loop, len(self.requests))):
                    self._issue()
            else:
                for req in self.requests:
                    self.loop.at(req.arrival, self._arrive, req)
            self.loop.at(0.0, self._heartbeat)
            self.loop.run(until)
        return self

    def _issue(self) -> None:
        if self._next_request < len(self.requests):
            req = self.requests[self._next_request]
            self._next_request += 1
            req.arrival = self.loop.now
            self._arrive(req)

    def _arrive(self, req: SimRequest) -> None:
        job = Job(req, queued_at=self.loop.now)
        self.jobs.append(job)
        self.queued_tokens += req.num_tokens
        self.admission.add(job, req.tier)
        self._pump()

    def _pump(self) -> None:
        limit = self.config.max_inflight or math.inf
        while self.inflight < limit:
            job = self.admission.next()
            if job is None:
                return
            self.inflight += 1
            self.queued_tokens -= job.req.num_tokens
            job.dispatched_at = self.loop.now
            if self.front is not None:
                self.front.submit(self.config.profile.frontdoor_cpu_s)
            self._dispatch(job)

    def _dispatch(self, job: Job) -> None:
        req, cfg = job.req, self.config
        bs = cfg.profile.block_size
        job.attempts += 1
        decode_workers = self.pool.decode_workers()
        try:
            if not decode_workers:
                raise NoWorkerError("no decode worker is ready")
            placement = place(self.policy, self.policy_config, cfg.disaggregation, self.pool, self.index,
                              decode_workers, self.pool.prefill_workers(), req.hashes, req.num_tokens, bs)
        except (CapacityError, NoWorkerError):
            self._wait(job)
            return
        # A worker that deregistered (drained, or gone) since the last refresh refuses the call UNAVAILABLE:
        # the Dispatcher marks it failed and tries again at once elsewhere (dispatch.py _failure)
        decode = self.workers.get(placement.decode.worker.worker_id)
        prefill = self.workers.get(placement.prefill.worker.worker_id) if placement.prefill else None
        gone = [p.worker.worker_id for p, w in ((placement.decode, decode), (placement.prefill, prefill))
                if p is not None and (w is None or w.draining)]
        if gone:
            # (quietly: production warns once per failed worker; here every drained worker would)
            disabled, worker_pool_log.disabled = worker_pool_log.disabled, True
            try:
                for worker_id in gone:
                    self.pool.mark_failed(worker_id)
            finally:
                worker_pool_log.disabled = disabled
            self.loop.after(0.0, self._dispatch, job)
            return
        job.blocks = -(-(req.num_tokens + req.out_tokens) // bs)
        if not decode.reserve(job):  # the heartbeat was stale: RESOURCE_EXHAUSTED, retry after a backoff
            self._wait(job)
            return
        job.decode_worker = decode.worker_id
        if placement.prefill is None:
            job.local = True
            job.token = self.pool.begin(decode.worker_id, req.num_tokens)
            decode.local_prefill(job)
            return
        job.prefill_worker = prefill.worker_id
        if placement.prefill.fetch is not None:  # the router's peer fetch: the holder's blocks copied, not computed
            job.extra["fetch"] = (placement.prefill.fetch.holder.worker_id, placement.prefill.fetch.blocks)
        job.token = begin_prefill(self.pool, self.index, placement.prefill, req.hashes, req.num_tokens, bs)
        job.decode_token = begin_decode(self.pool, placement.decode)
        prefill.submit(job)

    def _wait(self, job: Job) -> None:
        backoff = job.extra.get("backoff", 0.02)
        job.extra["backoff"] = min(backoff * 2, 0.5)
        self.loop.after(backoff, self._dispatch, job)

    def prefilled(self, job: Job, worker: PrefillWorker) -> None:
        job.extra["prefilled_at"] = self.loop.now
        self.computed_tokens += job.req.num_tokens - job.cached_tokens
        self.pool.end_prefill(job.token)
        self.loop.after(self.config.profile.transfer_s(job.req.num_tokens), self._kv_arrived, job)
        self._maybe_retire(worker)

    def _kv_arrived(self, job: Job) -> None:
        decode = self.workers_any(job.decode_worker)
        # the decode worker's event loop sends the first token when the engine step under way ends (the
        # engine thread holds the GIL through it), where the profile says the real worker does
        wait = decode.to_step_boundary(self.loop.now) if self.config.profile.first_token_at_step else 0.0
        if wait > 0:
            self.loop.after(wait, self._handed_off, job, decode)
        else:
            self._handed_off(job, decode)

    def _handed_off(self, job: Job, decode) -> None:
        self.first_token(job)
        decode.join(job)

    def workers_any(self, worker_id: str) -> SimWorker:
        worker = self.workers.get(worker_id)
        if worker is None:
            worker = next(w for w in self.retired if w.worker_id == worker_id)
        return worker

    def first_token(self, job: Job) -> None:
        if job.local:
            self.computed_tokens += job.req.num_tokens
        job.first_token_at = self.loop.now

    def finished(self, job: Job, worker: DecodeWorker) -> None:
        self.pool.end(job.token)
        if job.decode_token is not None:
            self.pool.end(job.decode_token)
        self.inflight -= 1
        if self.on_finished is not None:
            self.on_finished(job)
        self._maybe_retire(worker)
        if job.prefill_worker and job.prefill_worker in self.workers:
            self._maybe_retire(self.workers[job.prefill_worker])
        self._pump()
        if self.config.closed_loop:
            self._issue()

    # ---- heartbeats, samples, the autoscaler -------------------------------------------------
    def done(self) -> bool:
        return (self._next_request >= len(self.requests) if self.config.closed_loop
                else len(self.jobs) == len(self.requests)) and self.inflight == 0 and not len(self.admission)

    def _heartbeat(self) -> None:
        now = self.loop.now
        self.pool.update([w.heartbeat(now) for w in self._registered() if not w.draining])
        if now - self._last_sample >= self.config.sample_s:
            self._last_sample = now
            self.series.append(self.sample())
        if self.controller is not None:
            self.controller.tick(self)
        if not self.done():
            self.loop.after(self.config.heartbeat_s, self._heartbeat)

    def sample(self) -> dict:
        roles = {"prefill": [], "decode": []}
        for w in self.workers.values():
            roles[w.role].append(w)
        decode = [w for w in roles["decode"] if w.ready_at <= self.loop.now]
        kv_total = sum(w.profile.kv_blocks for w in decode) or 1
        return {"t": round(self.loop.now, 3), "queued": len(self.admission), "inflight": self.inflight,
                "prefill_workers": len(roles["prefill"]), "decode_workers": len(roles["decode"]),
                "prefill_queue": sum(len(w.queue) + (w.running is not None) for w in roles["prefill"]),
                "decode_running": sum(len(w.batch) for w in decode),
                "kv_usage": round(sum(w.blocks_used for w in decode) / kv_total, 4)}
