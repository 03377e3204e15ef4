"""Continuous batching: which requests run how many tokens this step. No torch.

Each request has ``num_computed_tokens`` (KV in the cache) and ``num_tokens``
(prompt + output so far); a step runs ``num_tokens - num_computed`` of them, up
to the token budget. That one rule covers a whole prompt, a prefill chunk, a
single decode token, and the recompute of a preempted request. A request
samples when its step brings it level with ``num_tokens``.

Speculative decoding: a running request that is decoding may carry draft tokens
(``Request.spec_token_ids``, set by the engine's Speculator); it then runs its last token
plus the drafts. Drafts get what budget and free blocks are left once every running
request has its own tokens (they never displace a sure token or cause a preemption), and
come before new admissions. The engine counts only the accepted ones as computed.

The batch limit (``max_num_seqs``) holds for requests prefilled elsewhere too: a
disaggregated decode worker's reservations are bounded by KV blocks only, so one whose
KV has arrived beyond the limit waits, holding its blocks, and takes the first free slot
ahead of new prompts (``add_running``), as vLLM's remote-KV requests wait in its queue.

Order: running requests first (priority, then arrival), so decodes are never
starved by new prompts; then waiting ones. When blocks run out the lowest
priority, latest running request is preempted: its blocks are freed (they stay
in the prefix cache, so recompute is often a cache hit) and it waits again.

A waiting request whose next uncached prompt block is being computed right now
by a running request (a burst sharing a prefix that is not cached yet) is
deferred: it stays waiting, others are admitted past it, and once that block is
cached (a step or a few later) it is admitted and hits it instead of computing
it again. The deferral ends when the block is cached or its computing request
finishes, is aborted or preempted (KVManager.waits_for_computing), so it cannot
deadlock: a running request always progresses.

A waiting request whose prefix is being restored from the spill tier (KVManager.restoring) is
deferred the same way until the copy, which runs off the engine thread, is done: the running
requests' steps go on meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from services.engine.kv_manager import KVManager
from services.engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 1024  # token budget per step
    max_num_seqs: int = 128  # running sequences at once
    long_prefill_chunk: int = 512  # most prompt tokens one request gets per step
    watermark_blocks: int = 0  # kept free when admitting new requests (avoids instant preemption)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.long_prefill_chunk < 1:
            raise ValueError("long_prefill_chunk must be >= 1")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens this step runs, draft tokens included
    # Speculative decoding: the draft tokens verified this step, after the request's last
    # token (num_new_tokens = 1 + len(spec_token_ids)); empty for every other row.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self._waiting: list[tuple[int, float, int, Request]] = []  # heap
        self._order = itertools.count()
        self.running: list[Request] = []  # sorted by (priority, arrival)
        # heap: requests whose KV was computed elsewhere (decode after a remote prefill), holding their blocks
        # until one of the max_num_seqs running slots frees; they take slots ahead of new prompts
        self._ready: list[tuple[int, float, int, Request]] = []
        self.num_preemptions = 0

    # ---- queue ----------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        heapq.heappush(self._waiting, (req.priority, req.arrival_time, next(self._order), req))

    def add_running(self, req: Request) -> None:
        """A request whose KV is already computed (decode after a remote prefill): it runs from the next step
        while fewer than ``max_num_seqs`` do, else it waits for a slot, as a disaggregated decode worker at
        capacity must (its reservations are bounded by KV blocks, not by the batch limit)."""
        req.status = Status.RUNNING
        if len(self.running) < self.config.max_num_seqs and not self._ready:
            self._insert_running(req)
        else:
            heapq.heappush(self._ready, (req.priority, req.arrival_time, next(self._order), req))

    def _insert_running(self, req: Request) -> None:
        key = (req.priority, req.arrival_time)
        i = len(self.running)
        while i and (self.running[i - 1].priority, self.running[i - 1].arrival_time) > key:
            i -= 1
        self.running.insert(i, req)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: prompts waiting, and computed ones waiting for a slot."""
        return (sum(1 for *_, r in self._waiting if r.status is Status.WAITING)
                + sum(1 for *_, r in self._ready if r.status is Status.RUNNING))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting whose KV is not computed yet (a router's load signal)."""
        # a waiting request's prefix that is cached, or being computed by a running request it will
        # wait for, is not computed for it: count only the rest
        waiting = sum(r.num_tokens - max(r.num_computed_tokens, self.kv.cached_prefix_tokens(r))
                      for *_, r in self._waiting if r.status is Status.WAITING)
        return waiting + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def remove(self, req: Request) -> None:
        """Drop a request from the queues (finish or abort); the caller frees blocks."""
        if req in self.running:
            self.running.remove(req)
        # waiting and ready entries are skipped lazily once their status changes

    # ---- the step -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk = self.config.long_prefill_chunk
        while self._ready and len(self.running) < self.config.max_num_seqs:
            *_, req = heapq.heappop(self._ready)
            if req.status is Status.RUNNING:  # else it finished (an abort) while it waited
                self._insert_running(req)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, chunk)
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
                continue
            # req itself was preempted; running[i] is now the next request

        budget = self._add_drafts(out, budget)

        if out.preempted:
            return out  # no admissions in a step that had to evict

        deferred = []  # heap entries of requests waiting for a block another request computes
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            *_, req = self._waiting[0]
            if req.status is not Status.WAITING:
                heapq.heappop(self._waiting)
                continue
            if not req.block_ids and self.kv.waits_for_computing(req):
                deferred.append(heapq.heappop(self._waiting))
                continue
            if not req.block_ids:
                self.kv.match_prefix(req)
            if self.kv.restoring(req):  # its prefix is being copied back from the spill tier: others go first
                deferred.append(heapq.heappop(self._waiting))
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, chunk)
            # The watermark keeps room for running requests to grow; with none running it
            # would only starve a request that needs the whole cache, forever.
            reserve = self.config.watermark_blocks if self.running else 0
            if not self.kv.allocate(req, n, reserve=reserve):
                self.kv.free(req)  # drop the prefix references until it fits
                break
            heapq.heappop(self._waiting)
            req.status = Status.RUNNING
            self._insert_running(req)
            self.kv.claim_computing(req)  # before the next admission, which may share this prefix
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Decoding requests' draft tokens join their rows while budget and free blocks last. Only
        after every running request has its own token: a guess never displaces a sure token or
        preempts anyone. Returns the budget left."""
        for s in out.scheduled:
            req = s.request
            if budget <= 0:
                break
            if not req.spec_token_ids or s.num_new_tokens != 1 or req.num_tokens - req.num_computed_tokens != 1:
                continue
            spec = req.spec_token_ids[:budget]
            if self.kv.allocate(req, 1 + len(spec)):
                s.spec_token_ids = spec
                s.num_new_tokens = 1 + len(spec)
                budget -= len(spec)
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        self.add(req)
