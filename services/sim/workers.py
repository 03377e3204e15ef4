"""Modelled workers: what a prefill and a decode worker do to a request, in virtual time.

They stand in for the processes and their transports; what the router sees of
them is what a real worker publishes: a ``WorkerInfo`` heartbeat (load, KV
blocks) and KV events (blocks stored and evicted) applied to the router's real
``PrefixIndex``.

Prefill worker: requests in arrival order, one at a time (on the CPU a batch of
prompts costs what they cost one by one; on a GPU a prompt of a few hundred
tokens already fills the device). Its prefix cache is an LRU of block hashes
with the worker's KV capacity; a request hits the leading run of its blocks
that is cached when it starts (a request whose prefix the previous one is
computing therefore hits it, as the engine's blocks-in-progress rule gives) and
stores the rest when it ends. With the router's peer fetch on, a prompt the router
sends with a fetch plan first copies the holder's leading blocks over the
profile's KV bandwidth, then computes the rest (``PrefillWorker._fetch``).

Decode worker: continuous batching modelled per batch, not per token. Between
two changes of its batch (a request joins or finishes) every step costs the
same ``decode_step_s(batch, context)``, so the worker keeps a step counter and
each request the step at which it finishes; one event per change. A local
prefill (conditional disaggregation) stalls the batch for its compute, as a
prefill chunk in the batch does. KV blocks are reserved for the prompt plus the
whole output when a request is placed (no preemption is modelled).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from services.engine.block_pool import SPILL
from services.kv_events import REMOVED, STORED
from services.registry import WorkerInfo
from services.router.fetch_cost import FIXED_S as FETCH_FIXED_S
from services.router.fetch_cost import HOLDER_STEP_TOKENS
from services.sim.profiles import WorkerProfile
from services.sim.workloads import SimRequest


@dataclass(slots=True)
class Job:
    """One request's journey through the modelled cluster (times in virtual seconds)."""

    req: SimRequest
    queued_at: float = 0.0
    dispatched_at: float = -1.0
    first_token_at: float = -1.0
    joined_at: float = -1.0
    finished_at: float = -1.0
    cached_tokens: int = 0
    blocks: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    token: object = None  # the router's in-flight token (the prefill worker's when disaggregated)
    decode_token: object = None  # a disaggregated request's on its decode worker
    finish_step: float = 0.0
    local: bool = False
    attempts: int = 0
    extra: dict = field(default_factory=dict)


class SimWorker:
    role = ""

    def __init__(self, sim, worker_id: str, profile: WorkerProfile, model: str, max_model_len: int):
        self.sim = sim
        self.profile = profile
        self.info = WorkerInfo(worker_id=worker_id, role=self.role, address=worker_id, model=model,
                               namespace=model, block_size=profile.block_size, max_model_len=max_model_len,
                               ready=True, kv_blocks_total=profile.kv_blocks,
                               kv_block_bytes=profile.kv_bytes_per_token * profile.block_size)
        self.busy_s = 0.0  # compute time spent (utilisation)
        self.draining = False
        self.host = getattr(sim, "host", None)  # a SharedHost (host.py) when workers share cores
        self.speed = 1.0  # of the calibrated speed: below 1 while the host's cores are oversubscribed

    def settle(self, now: float) -> None:
        """Account the work done until ``now`` at the current speed (the host's speed is changing)."""

    def retime(self, now: float) -> None:
        """Schedule the next event at the new speed."""

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def heartbeat(self, now: float) -> WorkerInfo:
        """The registry entry a heartbeat now would write (a copy: the router sees it until the next)."""
        info = copy.copy(self.info)
        self.report(info)
        info.draining = self.draining
        info.heartbeat_at = now
        return info

    def report(self, info: WorkerInfo) -> None:
        raise NotImplementedError

    def idle(self) -> bool:
        raise NotImplementedError


class PrefillWorker(SimWorker):
    role = "prefill"

    def __init__(self, *args):
        super().__init__(*args)
        self.cache: OrderedDict[int, None] = OrderedDict()  # block hash, least recently used first
        # the spill tier (ClusterConfig.prefill_spill_blocks): blocks evicted from the pool, least recent first
        self.spill: OrderedDict[int, None] = OrderedDict()
        self.spill_capacity = getattr(self.sim.config, "prefill_spill_blocks", 0)
        self.info.kv_spill_blocks_total = self.spill_capacity
        self.queue: deque[Job] = deque()
        self.queued_tokens = 0
        self.running: Job | None = None
        self._work = 0.0  # the running prefill's compute left, in seconds at full speed
        self._since = 0.0
        self._version = 0  # a re-timed prefill's earlier finish event is stale

    def report(self, info: WorkerInfo) -> None:
        info.num_running = 1 if self.running else 0
        info.num_waiting = len(self.queue)
        info.queued_prefill_tokens = self.queued_tokens
        info.kv_blocks_used = self.running.blocks if self.running else 0

    def idle(self) -> bool:
        return self.running is None and not self.queue

    def submit(self, job: Job) -> None:
        self.queue.append(job)
        self.queued_tokens += job.req.num_tokens
        if self.running is None:
            self._start()

    def _start(self) -> None:
        job = self.queue.popleft()
        self.running = job
        req = job.req
        held = self._lookup(job)
        fetch_s = self._fetch(job, held)
        new = req.num_tokens - max(held, job.extra.get("fetched_blocks", 0)) * self.profile.block_size
        duration = fetch_s + self.profile.prefill_s(new, req.num_tokens) + self.profile.prefill_request_s
        if "fetched_blocks" not in job.extra and job.extra.get("restored_blocks"):  # copied back from the spill tier
            duration += job.extra["restored_blocks"] * self.info.kv_block_bytes / self.sim.config.spill_restore_bytes_per_s
        self.busy_s += duration
        self._work, self._since = duration, self.sim.loop.now
        if self.host is not None:
            self.host.set_computing(self, True, self.sim.loop.now)
        self.retime(self.sim.loop.now)

    def settle(self, now: float) -> None:
        self._work -= (now - self._since) * self.speed
        self._since = now

    def retime(self, now: float) -> None:
        self._version += 1
        self.sim.loop.after(self._work / self.speed, self._finish, self.running, self._version)

    def _finish(self, job: Job, version: int) -> None:
        if version != self._version:
            return
        self._store(job)
        self.running = None
        if self.host is not None and not self.queue:
            self.host.set_computing(self, False, self.sim.loop.now)
        self.sim.prefilled(job, self)
        if self.queue:
            self._start()

    def _lookup(self, job: Job) -> int:
        """The request's leading run of cached blocks (refreshed in the LRU): its prefix hit."""
        req, cache, spill = job.req, self.cache, self.spill
        hit = restored = 0
        for h in req.hashes:
            if h in cache:
                hit += 1
            elif h in spill:  # in the spill tier: a hit that is copied back (at _store it is in the pool again)
                hit += 1
                restored += 1
            else:
                break
        for h in reversed(req.hashes[:hit]):  # the prompt's first block ends most recently used
            if h in cache:
                cache.move_to_end(h)
        job.cached_tokens = hit * self.profile.block_size
        job.extra["hit_blocks"] = hit
        job.extra["restored_blocks"] = restored
        return hit

    def _fetch(self, job: Job, held: int) -> float:
        """A peer fetch the router planned (``job.extra["fetch"]``: the holder and its blocks): the leading blocks
        the holder still holds beyond this worker's own are copied here before the rest is computed. Its time:
        the blocks over the profile's KV bandwidth, the fetch's round trips (fetch_cost.FIXED_S), and the
        holder's prefill under way up to one long-prefill chunk (it serves a fetch ahead of its queue). The
        fetched tokens count as cached (``job.cached_tokens``) and the blocks are cached here when it is done."""
        plan = job.extra.get("fetch")
        if plan is None:
            return 0.0
        holder_id, blocks = plan
        holder = self.sim.workers.get(holder_id)
        if holder is None or holder.draining:  # gone since the plan: its cache went with it
            return 0.0
        have = 0
        for h in job.req.hashes[:blocks]:
            if h not in holder.cache and h not in holder.spill:
                break
            have += 1
        if have <= held:
            return 0.0
        job.extra["fetched_blocks"] = have
        job.cached_tokens = have * self.profile.block_size
        step = (min(HOLDER_STEP_TOKENS, holder.running.req.num_tokens - holder.running.cached_tokens)
                * self.profile.prefill_per_token_s if holder.running is not None else 0.0)
        return (have * self.info.kv_block_bytes / self.profile.transfer_bytes_per_s + FETCH_FIXED_S + step)

    def _store(self, job: Job) -> None:
        """The prompt is computed: its blocks are cached (the LRU evicts beyond capacity), KV events out."""
        req, cache, spill = job.req, self.cache, self.spill
        # copied back into the pool (or computed again past the hit); no spill tier, nothing to look up
        back = [h for h in req.hashes if h in spill] if spill else []
        for h in back:
            del spill[h]
        stored = [h for h in req.hashes[job.extra["hit_blocks"]:] if h not in cache and h not in back] + back
        for h in reversed(req.hashes):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None  # a new key goes in last: most recent
        evicted = []
        while len(cache) > self.profile.kv_blocks:
            evicted.append(cache.popitem(last=False)[0])
        spilled, removed = (evicted, []) if self.spill_capacity else ([], evicted)
        for h in spilled:
            spill[h] = None
        while len(spill) > self.spill_capacity:
            removed.append(spill.popitem(last=False)[0])
        runs = [(STORED, stored)] + ([(STORED, spilled, SPILL)] if spilled else []) + [(REMOVED, removed)]
        self.sim.kv_events(self.worker_id, runs)
        self.queued_tokens -= req.num_tokens


class DecodeWorker(SimWorker):
    role = "decode"

    def __init__(self, *args):
        super().__init__(*args)
        self.blocks_used = 0
        self.steps = 0.0
        self.sum_ctx = 0.0
        self.batch: list = []  # heap of (finish step, job id, job)
        self.waiting: deque[Job] = deque()  # KV here, batch full
        self.last = 0.0
        self.stall_until = 0.0
        self.pending_local_tokens = 0
        self.version = 0
        self.loop_busy_s = 0.0  # its event loop's CPU beside the steps (the profile's decode_loop_cpu_share)

    def report(self, info: WorkerInfo) -> None:
        info.num_running = len(self.batch)
        info.num_waiting = len(self.waiting)
        info.queued_prefill_tokens = self.pending_local_tokens
        info.kv_blocks_used = self.blocks_used

    def idle(self) -> bool:
        return not self.batch and not self.waiting and self.blocks_used == 0

    def free_blocks(self) -> int:
        return self.profile.kv_blocks - self.blocks_used

    def reserve(self, job: Job) -> bool:
        """Hold the request's blocks; False (RESOURCE_EXHAUSTED) when they do not fit."""
        if job.blocks > self.free_blocks() or self.draining:
            return False
        self.blocks_used += job.blocks
        return True

    def step_s(self) -> float:
        return self.profile.decode_step_s(len(self.batch), self.sum_ctx)

    def to_step_boundary(self, now: float) -> float:
        """Seconds until the step under way ends (0 when idle or between steps)."""
        self._advance(now)
        if not self.batch:
            return 0.0
        left = math.ceil(self.steps - 1e-9) - self.steps
        return left * self.step_s() / self.speed if left > 1e-9 else 0.0

    def _advance(self, now: float) -> None:
        dt = now - self.last
        if self.stall_until > self.last:
            dt -= min(now, self.stall_until) - self.last
        if self.batch and dt > 0:
            step = self.step_s()
            k = dt * self.speed / step
            self.steps += k
            self.sum_ctx += len(self.batch) * k
            self.busy_s += dt * self.speed  # compute: at a shared host's speed, the wall time is longer
            self.loop_busy_s += dt * self.speed * self.profile.decode_loop_cpu_share
        self.last = now

    @property
    def threads(self) -> float:
        """Runnable threads while it computes (host.py): the engine's, and its event loop's share beside it."""
        return 1.0 + self.profile.decode_loop_cpu_share

    def local_prefill(self, job: Job) -> None:
        """Compute the prompt here: the batch stalls for it; the first token comes at its end."""
        now = self.sim.loop.now
        self._advance(now)
        duration = self.profile.prefill_s(job.req.num_tokens, job.req.num_tokens)
        self.busy_s += duration
        self.pending_local_tokens += job.req.num_tokens
        self.stall_until = max(self.stall_until, now) + duration
        self.sim.loop.at(self.stall_until, self._local_done, job)
        self._reschedule(now)

    def _local_done(self, job: Job) -> None:
        self.pending_local_tokens -= job.req.num_tokens
        self.sim.first_token(job)
        self.join(job)

    def join(self, job: Job) -> None:
        """The request's KV is here and its first token sent: it joins the batch (or waits for a slot)."""
        now = self.sim.loop.now
        self._advance(now)
        if job.req.out_tokens <= 1:
            self._done(job, now)
        elif len(self.batch) >= self.profile.max_num_seqs:
            self.waiting.append(job)
        else:
            self._add(job, now)
        self._reschedule(now)

    def _add(self, job: Job, now: float) -> None:
        job.joined_at = now
        job.finish_step = self.steps + job.req.out_tokens - 1
        heapq.heappush(self.batch, (job.finish_step, job.req.id, job))
        self.sum_ctx += job.req.num_tokens + 1

    def _reschedule(self, now: float) -> None:
        if self.host is not None:
            self.host.set_computing(self, bool(self.batch), now)
        self.retime(now)

    def settle(self, now: float) -> None:
        self._advance(now)

    def retime(self, now: float) -> None:
        self.version += 1
        if self.batch:  # (a local prefill's stall is not slowed by a shared host: the validation has none)
            ahead = max(0.0, self.batch[0][0] - self.steps) * self.step_s() / self.speed
            self.sim.loop.at(max(now, self.stall_until) + ahead, self._on_finish, self.version)

    def _on_finish(self, version: int) -> None:
        if version != self.version:
            return
        now = self.sim.loop.now
        self._advance(now)
        while self.batch and self.batch[0][0] <= self.steps + 1e-6:
            _, _, job = heapq.heappop(self.batch)
            self.sum_ctx = max(0.0, self.sum_ctx - job.req.num_tokens - job.req.out_tokens)
            self._done(job, now)
        while self.waiting and len(self.batch) < self.profile.max_num_seqs:
            self._add(self.waiting.popleft(), now)
        if not self.batch:
            self.sum_ctx = 0.0
        self._reschedule(now)

    def _done(self, job: Job, now: float) -> None:
        self.blocks_used -= job.blocks
        job.finished_at = now
        self.sim.finished(job, self)
