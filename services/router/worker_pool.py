"""The router's view of the live workers: the registry, refreshed, plus what this router has in flight.

Heartbeats (about 1 s apart) are too slow for bursts: fifty requests arriving in
one heartbeat would all see the same idle worker. So the router also counts
what it has sent itself: ``begin`` when it dispatches (a disaggregated request
on both its workers, placement.begin_prefill and begin_decode), ``end`` when the
worker is done with the request (``end_prefill`` when only the prefill part is). A
request a worker already reported in its heartbeat is then counted twice
until it ends; that errs towards spreading, which is the safe direction.

Exclusion: a worker is offered to policies only while it is ready, not
draining, and not marked failed. ``mark_failed`` (its RPC just failed) holds it
out for a window and until a heartbeat newer than the window's end arrives, so
a worker that died is not retried before its registry entry expires. A worker
whose entry expires leaves the pool and ``on_removed`` is told (the router
drops it from the prefix index).

The pool follows the registry (registry_follower.py): the changes workers
publish, applied in batches at most once per ``refresh_s``, and a whole read
every ``reread_s`` (entries that expired: workers that died).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.loops import Loops
from services.registry import WorkerInfo, read_workers
from services.registry_follower import RegistryFollower
from services.router.load_ranking import LoadRanking

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as the router sees it: last heartbeat plus this router's in-flight work."""

    worker_id: str
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_free: int = 0
    inflight_requests: int = 0
    inflight_prefill_tokens: int = 0
    ended_since_beat: int = 0  # this router's requests that ended after the heartbeat counted them

    # Derived counts, computed once when the load is built: policies and the pool's rankings read them
    # for many workers per request, and a pool's WorkerLoad lives until that worker's heartbeat or
    # in-flight counts change (WorkerPool.load). (functools.cached_property takes a lock per first read.)
    # pending_prefill_tokens: prompt tokens ahead of a new request, reported queue plus what this router sent since.
    pending_prefill_tokens: int = field(init=False, compare=False)
    num_requests: int = field(init=False, compare=False)
    # decode_rank: the shared decode choice's order, fewest requests, then most free blocks.
    decode_rank: tuple[int, int] = field(init=False, compare=False)
    # active_requests: requests on the worker, none counted twice: the larger of its heartbeat's count
    # (other routers' requests too, up to a second old), less this router's requests that ended since
    # that heartbeat, and this router's exact in-flight count. Without the discount a conversation's
    # next turn, sent as its last one ends, would find that one still counted.
    active_requests: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        derive = object.__setattr__  # frozen
        derive(self, "pending_prefill_tokens", self.queued_prefill_tokens + self.inflight_prefill_tokens)
        requests = self.num_running + self.num_waiting
        derive(self, "num_requests", requests + self.inflight_requests)
        derive(self, "decode_rank", (requests + self.inflight_requests, -self.kv_blocks_free))
        derive(self, "active_requests", max(requests - self.ended_since_beat, self.inflight_requests))


class ReadyWorkers(list):
    """What ``decode_workers()`` / ``prefill_workers()`` return while no worker is held out: the role's
    ready workers in id order as of one registry update. A policy handed this list itself (not one a
    caller filtered) knows it is sorted and is what the pool ranks, and skips re-checking both."""

    __slots__ = ("generation", "pool", "role")


@dataclass(frozen=True)
class InflightToken:
    """Opaque handle from ``begin``; hand it to ``end`` exactly once (a second ``end`` is a no-op)."""

    id: int
    worker_id: str


@dataclass
class _Tracked:
    info: WorkerInfo
    beat_seen_at: float  # router clock when a new heartbeat_at was last observed
    beats: int = 0  # new heartbeats observed
    ended_since_beat: int = 0  # requests begun before the last observed beat, ended after it


class WorkerPool:
    def __init__(self, redis, refresh_s: float = 0.5, model: str | None = None,
                 on_removed: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, reread_s: float = 1.0):
        if refresh_s <= 0 or reread_s <= 0:
            raise ValueError(f"refresh_s and reread_s must be positive, got {refresh_s} and {reread_s}")
        self.redis = redis
        self.refresh_s = refresh_s  # the most a published change waits before it is applied
        self.reread_s = reread_s  # the whole registry is read this often
        self.registry_reads = 0  # whole-registry reads so far (tests count them)
        self.model = model  # None: every model's workers
        self.on_removed = on_removed
        self._clock = clock
        self._workers: dict[str, _Tracked] = {}
        self._failed_until: dict[str, float] = {}  # worker id -> router clock
        self._tokens: dict[int, tuple[str, int]] = {}  # token id -> (worker id, prefill tokens)
        self._begun_at_beat: dict[int, int] = {}  # token id -> its worker's beats when it began
        self._inflight: dict[str, list[int]] = {}  # worker id -> [requests, prefill tokens]
        self._ids = itertools.count()
        # worker id -> its WorkerLoad until its heartbeat or in-flight counts change: a policy reads
        # every worker's load for every request, and with hundreds of workers building them dominated
        self._loads: dict[str, WorkerLoad] = {}
        # role -> its ready, not draining workers by id, until the next update: what every dispatch
        # asks for; rebuilding it per request was most of the router's time at 1,000 workers
        self._by_role: dict[str, list[WorkerInfo]] | None = None
        self._by_role_ids: dict[str, dict[str, WorkerInfo]] = {}
        # (role, model) -> that model's part of _by_role (its pool), and the models announced, until the next update
        self._by_model: dict[tuple[str, str], list[WorkerInfo]] = {}
        self._models: list[str] | None = None
        self.generation = 0  # registry updates seen (a ReadyWorkers list is of one)
        # (role, key) -> that role's usable workers in order of key(load), for policies that want the
        # least loaded first (load_ranking.py); rebuilt after an update, re-keyed as loads change
        self._rankings: dict[tuple[str, Callable], LoadRanking] = {}
        self._dirty: set[str] = set()  # workers whose load changed since the rankings last caught up
        self._loops = Loops()

    # ---- registry -------------------------------------------------------
    async def start(self) -> None:
        """First refresh now (errors propagate: a router without Redis cannot route), then in the background."""
        await self.refresh()
        follower = RegistryFollower(self.redis, self.refresh, self.apply_changes, self.refresh_s, self.reread_s,
                                    lambda: self._loops.stopping)
        self._loops.start({"worker-pool-refresh": follower.run})

    async def stop(self) -> None:
        await self._loops.stop(min(self.refresh_s, self.reread_s) + 0.5)

    async def refresh(self) -> None:
        self.registry_reads += 1
        self.update(await read_workers(self.redis))

    def apply_changes(self, changes: dict[str, WorkerInfo | None]) -> None:
        """Published changes: worker id -> its new entry, or None for a worker that left."""
        known = {worker_id: tracked.info for worker_id, tracked in self._workers.items()}
        for worker_id, info in changes.items():
            if info is None:
                known.pop(worker_id, None)
            else:
                known[worker_id] = info
        self.update(known.values())

    def update(self, workers: Iterable[WorkerInfo]) -> None:
        """Replace the known set with ``workers`` (what the registry holds now)."""
        now = self._clock()
        self._loads.clear()
        self._by_role = self._models = None
        self._rankings.clear()
        self._dirty.clear()
        self.generation += 1
        fresh = {w.worker_id: w for w in workers if self.model is None or w.model == self.model}
        for worker_id in [w for w in self._workers if w not in fresh]:
            del self._workers[worker_id]
            self._failed_until.pop(worker_id, None)
            log.info("worker %s left the pool", worker_id)
            if self.on_removed is not None:
                try:
                    self.on_removed(worker_id)
                except Exception:
                    log.exception("on_removed(%s) failed", worker_id)
        for worker_id, info in fresh.items():
            old = self._workers.get(worker_id)
            if old is None:
                log.info("worker %s (%s at %s) joined the pool", worker_id, info.role, info.address)
                self._workers[worker_id] = _Tracked(info, now)
            else:
                if info.heartbeat_at != old.info.heartbeat_at:
                    old.beat_seen_at = now
                    old.beats += 1
                    old.ended_since_beat = 0
                old.info = info

    # ---- who can take work ------------------------------------------------
    def workers(self) -> list[WorkerInfo]:
        """Every known worker of the model, usable or not, by id."""
        return [self._workers[w].info for w in sorted(self._workers)]

    def get(self, worker_id: str) -> WorkerInfo | None:
        tracked = self._workers.get(worker_id)
        return tracked.info if tracked is not None else None

    def is_usable(self, worker_id: str) -> bool:
        tracked = self._workers.get(worker_id)
        if tracked is None or not tracked.info.ready or tracked.info.draining:
            return False
        until = self._failed_until.get(worker_id)
        if until is not None:
            # Back only once the window passed *and* the worker heartbeated after it.
            if self._clock() < until or tracked.beat_seen_at < until:
                return False
            del self._failed_until[worker_id]
        return True

    def prefill_workers(self, model: str = "") -> list[WorkerInfo]:
        """Usable prefill workers of ``model`` (its pool; "": every model's)."""
        return self._usable("prefill", model)

    def decode_workers(self, model: str = "") -> list[WorkerInfo]:
        """Usable decode workers of ``model`` (its pool; "": every model's)."""
        return self._usable("decode", model)

    def models(self) -> list[str]:
        """The models the known workers announce, sorted (kept until the next update)."""
        if self._models is None:
            self._models = sorted({t.info.model for t in self._workers.values()})
        return self._models

    def _usable(self, role: str, model: str = "") -> list[WorkerInfo]:
        ready = self._usable_by_role().get(role, [])
        if model:
            mine = self._by_model.get((role, model), [])
            if len(mine) != len(ready):
                # other models' workers share the role: a plain list, so that policies rank only these
                # (a ReadyWorkers list stands for the whole role: policy._pool_view)
                return [info for info in mine if not self._failed_until or self.is_usable(info.worker_id)]
            # one model served (the usual case): its pool is the role's list, tagged as such below
        if not self._failed_until:  # the common case: nobody is held out, no clock to check
            out = ReadyWorkers(ready)
            out.pool, out.role, out.generation = self, role, self.generation
            return out
        return [info for info in ready if self.is_usable(info.worker_id)]

    def _usable_by_role(self) -> dict[str, list[WorkerInfo]]:
        if self._by_role is None:
            self._by_role, self._by_role_ids, self._by_model = {}, {}, {}
            for w in sorted(self._workers):
                info = self._workers[w].info
                if info.ready and not info.draining:
                    self._by_role.setdefault(info.role, []).append(info)
                    self._by_role_ids.setdefault(info.role, {})[w] = info
                    self._by_model.setdefault((info.role, info.model), []).append(info)
        return self._by_role

    def ready_by_id(self, role: str) -> dict[str, WorkerInfo]:
        """The ready, not draining workers of ``role`` by id, in id order (failed ones too), until the
        next update: what ``decode_workers()`` / ``prefill_workers()`` return while none is held out.
        Read only."""
        self._usable_by_role()
        return self._by_role_ids.get(role, {})

    def mark_failed(self, worker_id: str, for_s: float = 5.0) -> None:
        """Hold ``worker_id`` out of routing now, for ``for_s`` and until it heartbeats after that."""
        until = self._clock() + for_s
        self._failed_until[worker_id] = max(until, self._failed_until.get(worker_id, until))
        log.warning("worker %s marked failed for %.1fs", worker_id, for_s)

    # ---- in-flight accounting ---------------------------------------------
    def begin(self, worker_id: str, prefill_tokens: int = 0) -> InflightToken:
        """Count a request dispatched to ``worker_id`` with ``prefill_tokens`` still to compute there."""
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        token = InflightToken(next(self._ids), worker_id)
        self._tokens[token.id] = (worker_id, prefill_tokens)
        tracked = self._workers.get(worker_id)
        self._begun_at_beat[token.id] = tracked.beats if tracked is not None else -1
        self._changed(worker_id)
        counts = self._inflight.setdefault(worker_id, [0, 0])
        counts[0] += 1
        counts[1] += prefill_tokens
        return token

    def end_prefill(self, token: InflightToken) -> None:
        """The request's prefill finished; it stays in flight (e.g. decoding after a local prefill)."""
        entry = self._tokens.get(token.id)
        if entry is not None and entry[1]:
            self._changed(entry[0])
            self._inflight[entry[0]][1] -= entry[1]
            self._tokens[token.id] = (entry[0], 0)

    def end(self, token: InflightToken) -> None:
        """The worker is done with the request (any outcome). Idempotent."""
        entry = self._tokens.pop(token.id, None)
        if entry is None:
            return
        worker_id, prefill_tokens = entry
        self._changed(worker_id)
        tracked = self._workers.get(worker_id)
        # a heartbeat observed after it began may count it as running until the next one arrives
        if tracked is not None and self._begun_at_beat.pop(token.id, tracked.beats) < tracked.beats:
            tracked.ended_since_beat += 1
        counts = self._inflight[worker_id]
        counts[0] -= 1
        counts[1] -= prefill_tokens
        if counts[0] == 0:
            del self._inflight[worker_id]

    def _changed(self, worker_id: str) -> None:
        self._loads.pop(worker_id, None)
        if self._rankings:
            self._dirty.add(worker_id)

    def ranked(self, role: str, key: Callable[[WorkerLoad], object]) -> LoadRanking:
        """The ready, not draining workers of ``role`` in order of ``key(load)``, lowest first (then by
        id), current as of now. ``key`` must be the same object (or an equal one: a bound method) on
        every call for the ranking to be kept between calls. Workers marked failed are still in it."""
        ranking = self._rankings.get((role, key))
        if ranking is None:
            self._catch_up()
            ranking = self._rankings[(role, key)] = LoadRanking(key)
            for info in self._usable_by_role().get(role, ()):
                ranking.set(info.worker_id, self.load(info.worker_id))
            return ranking
        self._catch_up()
        return ranking

    def _catch_up(self) -> None:
        if not self._dirty:
            return
        for worker_id in self._dirty:
            for ranking in self._rankings.values():
                if worker_id in ranking.members():
                    ranking.set(worker_id, self.load(worker_id))
        self._dirty.clear()

    def load(self, worker_id: str) -> WorkerLoad:
        """Heartbeat fields plus this router's in-flight counts. KeyError for an unknown worker."""
        cached = self._loads.get(worker_id)
        if cached is not None:
            return cached
        tracked = self._workers[worker_id]
        info = tracked.info
        requests, prefill_tokens = self._inflight.get(worker_id, (0, 0))
        load = self._loads[worker_id] = WorkerLoad(
            worker_id=worker_id, num_running=info.num_running, num_waiting=info.num_waiting,
            queued_prefill_tokens=info.queued_prefill_tokens, kv_blocks_free=info.kv_blocks_free,
            inflight_requests=requests, inflight_prefill_tokens=prefill_tokens,
            ended_since_beat=tracked.ended_since_beat)
        return load
