"""A prefill worker that runs the engine scheduler's steps: chunked prompts, several per step.

The plain ``PrefillWorker`` computes one prompt at a time, whole. The real engine
(``services/engine/scheduler.py``) does not: each step takes up to
``max_num_batched_tokens`` prompt tokens (1,024 by default), at most
``long_prefill_chunk`` (512) of them from any one request, the requests already
running first and then new ones from the queue in order. So a short prompt (a
prefix hit) that arrives while a long one computes goes into the same step and
ends with that step, not after the whole long prompt; and two long prompts
progress together and end together. The total compute is the same; who waits
for whom is not, which is what TTFT percentiles measure.

A profile selects this worker with ``prefill_step_tokens`` > 0 (the cpu profile:
the engine defaults ``pdserve bench routing`` runs; the measured GPU profiles: 8,192
tokens a step, whole prompts, as ``calibrate.py`` ran the engine). A step of chunks ``n_i``
ending at context ``c_i`` costs ``base + per_token * sum(n_i) + per_token_context *
sum(n_i * c_i)``: the calibration's fit (``calibrate.py``), which timed one request per step,
applied per step: its base is paid once a step however many prompts the step carries
(``benchmarks/probes/prefill_step_batching.py``: on an H200, 8 prompts of 16 tokens in one
step took 27 ms, one alone 17 ms). A request whose first uncached block another running request is
computing waits for it (the scheduler's blocks-in-progress rule) and then hits it.
"""

from __future__ import annotations

from collections import deque

from services.kv_events import REMOVED
from services.sim.workers import Job, PrefillWorker


def _release(counts: dict[int, int], hashes) -> None:
    for h in hashes:
        left = counts[h] - 1
        if left:
            counts[h] = left
        else:
            del counts[h]


class SteppedPrefillWorker(PrefillWorker):
    def __init__(self, *args):
        super().__init__(*args)
        self.active: list[Job] = []  # admitted, computing, in admission order
        self.computing: dict[int, int] = {}  # block hash -> active requests computing it
        self.pinned: dict[int, int] = {}  # cached block hash -> active requests that hit it (not evictable)
        self.allocated = 0  # blocks the active requests compute into (beside the cache)
        self._step_work: list[tuple[Job, int]] = []  # this step's (request, tokens)

    def report(self, info) -> None:
        info.num_running = len(self.active)
        info.num_waiting = len(self.queue)
        info.queued_prefill_tokens = self.uncomputed_tokens()
        info.kv_blocks_used = sum(job.blocks for job in self.active)

    def uncomputed_tokens(self) -> int:
        """The engine's load signal (``Scheduler.queued_prefill_tokens``): prompt tokens not computed yet,
        a waiting request's prefix that is cached here or being computed for another not counted. The
        whole prompt overstated a hot prefix's holder (1,040 tokens for a 24-token hit), so the router's
        kv-aware cost sent its requests to the other worker, which computed the prefix again."""
        bs, waiting = self.profile.block_size, 0
        for job in self.queue:
            hit = 0
            for h in job.req.hashes:
                if h not in self.cache and h not in self.computing:
                    break
                hit += 1
            waiting += job.req.num_tokens - hit * bs
        return waiting + sum(job.extra["left"] for job in self.active)

    def idle(self) -> bool:
        return not self.active and not self.queue

    def submit(self, job: Job) -> None:
        self.queue.append(job)
        self.queued_tokens += job.req.num_tokens
        if not self._step_work:
            self._step()

    def _admit(self, job: Job) -> None:
        hit = self._lookup(job)
        req, bs = job.req, self.profile.block_size
        job.extra["admitted_at"] = self.sim.loop.now
        job.extra["left"] = max(1, req.num_tokens - hit * bs)  # the last token always
        job.extra["context"] = req.num_tokens - job.extra["left"]
        job.extra["allocated"] = -(-req.num_tokens // bs) - hit
        for h in req.hashes[hit:]:
            self.computing[h] = self.computing.get(h, 0) + 1
        for h in req.hashes[:hit]:
            self.pinned[h] = self.pinned.get(h, 0) + 1
        self.active.append(job)
        # The engine allocates the blocks it computes into at admission, evicting the least recently
        # used cached blocks no running request holds (the cache shrinks now, not when the prompt ends)
        self.allocated += job.extra["allocated"]
        removed = []
        over = len(self.cache) + self.allocated - self.profile.kv_blocks
        if over > 0:  # one walk from the least recent past the pinned blocks (not one from the front per victim)
            pinned = self.pinned
            for h in self.cache:
                if h not in pinned:
                    removed.append(h)
                    if len(removed) == over:
                        break
            for h in removed:
                del self.cache[h]
        if removed:
            self.sim.kv_events(self.worker_id, [(REMOVED, removed)])

    def _waits(self, job: Job) -> bool:
        """Its first block not cached is one a running request computes: it waits to hit it."""
        hashes = job.req.hashes
        for h in hashes:
            if h not in self.cache:
                return h in self.computing
        return False

    def _step(self) -> None:
        """Compose the next step (running requests first, then the queue in order) and time it."""
        p = self.profile
        budget, chunk = p.prefill_step_tokens, p.prefill_chunk_tokens or p.prefill_step_tokens
        work = []
        for job in self.active:
            if budget <= 0:
                break
            n = min(job.extra["left"], budget, chunk)
            work.append((job, n))
            budget -= n
        deferred = deque()
        while self.queue and budget > 0:
            job = self.queue.popleft()
            if self._waits(job):
                deferred.append(job)
                continue
            self._admit(job)
            n = min(job.extra["left"], budget, chunk)
            work.append((job, n))
            budget -= n
        deferred.extend(self.queue)
        self.queue = deferred
        self._step_work = work
        now = self.sim.loop.now
        if not work:
            if self.host is not None:
                self.host.set_computing(self, False, now)
            return
        tokens = sum(n for _, n in work)
        attention = sum(n * (job.extra["context"] + n) for job, n in work)
        finishing = sum(1 for job, n in work if n >= job.extra["left"])  # each sends its prompt's KV after
        duration = (p.prefill_base_s + p.prefill_per_token_s * tokens + p.prefill_per_token_context_s * attention
                    + p.prefill_request_s * finishing)
        self.busy_s += duration
        self._work, self._since = duration, now
        if self.host is not None:
            self.host.set_computing(self, True, now)
        self.retime(now)

    def retime(self, now: float) -> None:
        self._version += 1
        self.sim.loop.after(self._work / self.speed, self._step_done, self._version)

    def _step_done(self, version: int) -> None:
        if version != self._version:
            return
        done = []
        for job, n in self._step_work:
            job.extra["left"] -= n
            job.extra["context"] += n
            if job.extra["left"] <= 0:
                done.append(job)
        for job in done:
            self.active.remove(job)
            hit = job.extra["hit_blocks"]
            _release(self.computing, job.req.hashes[hit:])
            _release(self.pinned, job.req.hashes[:hit])
            self.allocated -= job.extra["allocated"]
            self._store(job)
        self._step_work = []
        for job in done:
            self.sim.prefilled(job, self)
        self._step()
