"""Routing policies: which prefill worker computes a prompt, which decode worker runs it.

``kv-aware`` (the default) scores each prefill worker by the work a request
would cost there, in prompt tokens; lower wins::

    cost = uncached_tokens                                   # prompt tokens not in its prefix cache
         + load_weight   * max(queued_prefill_tokens, inflight_prefill_tokens)
         + request_tokens * max(num_running + num_waiting, inflight_requests)
         + block_size * reused_evictions                     # shared blocks it would push out

    uncached_tokens = num_tokens - overlap_blocks * block_size
                    + restore_token_cost * block_size * spilled_blocks   # in its spill tier

A block the worker holds in its spill tier (``--kv-spill-gb``; the index knows from its KV
events) is a hit that costs a copy back: ``restore_token_cost`` (0.05) of a token per token.
Measured (BENCHMARKS.md, ``pdserve bench kvtier``, default model on one CPU core): a restore
~0.34 ms per block plus ~0.5 ms for the spill it causes, against ~25 ms to prefill the block's
16 tokens, about 0.03; 0.05 rounds that up. So a worker with the prefix spilled still beats one
without it by far, and one with it in its pool beats both.

A token computed counts more than a token waited for (``load_weight`` < 1): the
compute is paid again by every request that queues behind it on that worker,
and a prefix computed on a second worker is a copy that takes cache from other
prefixes. ``reused_evictions`` (``PrefixIndex.reused_evictions``) counts the
blocks that served more than one prompt which the worker's LRU cache would drop
to make room for this prompt's uncached blocks: they are likely wanted again,
so dropping one costs its recompute later. So a cached prefix keeps its
requests until the holder's queue is several times longer than the prefix it
saves (a hot prefix still spills under real overload), and a new prefix goes to
the worker with cache to spare rather than evicting another worker's working
set: with more prefixes than one worker holds, they end up partitioned between
the workers instead of copied onto both.

Candidates within ``tie_tokens`` of the best are sampled with weights
``exp(-(cost - best) / (temperature * tie_tokens))``; ``temperature`` 0 takes
the cheapest, first by worker id on an exact tie (deterministic). Sampling
keeps several routers with one view of the cluster from herding onto one worker.

Session affinity (every policy): a request with a session key goes to its key's
decode worker (``affinity.SessionAffinity``: consistent hashing with bounded
loads; over the bound, the next worker on the key's ring, ``affinity_spill``)
unless another decode worker under the bound holds at least
``affinity_override_blocks`` more of the prompt's leading full blocks, as the
prefix index records them: then the one holding the most. The decode worker is
where a conversation's whole history (its prompts and outputs) stays cached and
where a local prefill computes. The prefill choice ignores the key: kv-aware
already sends a prompt to the prefill worker its previous turn went to (the
index records each choice at once), and weighs that cache against the worker's
queue better than a ring does (``pdserve bench routing --workload multi-turn
--prefill 2``: pinning prefills by key raised TTFT by half at the same hit rate).

Peer fetch (``peer_fetch``, off by default): a worker's uncached tokens become the cheaper of
computing them and fetching the prefix from the worker that holds more of it over kvtransfer
(``fetch_cost.py`` has the model: transfer bytes over bandwidth, the holder's step in progress
and its restores, against prefill time for those tokens). So kv-aware weighs three choices: the
holder (its queue), another worker computing, another worker fetching. The chosen worker's
``Decision.fetch`` names the holder and the blocks; with ``least-load`` and ``round-robin`` the
chosen worker fetches where that is cheaper than computing.

``least-load`` takes the fewest pending prefill tokens; ``round-robin`` cycles
over workers by id. Decode choice is shared: only workers with enough free KV
blocks, then the fewest requests, then the most free blocks (round-robin cycles
over those that fit).

Pure logic: no torch, no gRPC. Policies read loads from a ``WorkerPool`` and
overlaps from a ``PrefixIndex``; they never mutate either (the caller calls
``pool.begin`` with the chosen worker).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields

from services.errors import CapacityError, NoWorkerError
from services.registry import WorkerInfo
from services.router.affinity import SessionAffinity
from services.router.fetch_cost import FetchPlan, plan_fetch
from services.router.load_ranking import LoadRanking
from services.router.prefix_index import PrefixIndex
from services.router.worker_pool import ReadyWorkers, WorkerLoad, WorkerPool

POLICY_NAMES = ("kv-aware", "least-load", "round-robin")


@dataclass
class RouterPolicyConfig:
    policy: str = "kv-aware"
    # Prompt tokens of cost per prompt token queued or in flight on a worker. 1.0: waiting behind
    # a token costs as much as computing one of your own, so a holder loses a prefix's requests as
    # soon as one other prefill of that size is queued on it (and the prefix is copied to another
    # worker). 0.25: computing one costs four waited ones (this request's wait, the waits of those
    # queued behind it, the cache its KV takes), so the holder keeps them until about four such
    # prefills are queued there. BENCHMARKS.md ("pdserve bench routing") has the measurements.
    load_weight: float = 0.25
    # A prompt token whose KV is in the worker's spill tier costs this many computed ones (a copy back).
    restore_token_cost: float = 0.05
    # Fixed cost per request on a worker (scheduling, a batch slot), in prompt tokens.
    request_tokens: float = 8.0
    # Costs within this many tokens of the best are near-ties, sampled by temperature.
    tie_tokens: float = 32.0
    # 0: deterministic (cheapest, then first by id). 1: a near-tie ``tie_tokens`` worse is e times less likely.
    temperature: float = 0.0
    seed: int | None = None
    # Conditional disaggregation (``should_prefill_locally``). 0 disables local prefill of short
    # prompts: with prefill workers present every prompt is disaggregated, so a deployment
    # behaves as configured unless it opts in (a few hundred tokens suits GPUs, where a short
    # prefill costs less than the hand-off's round trip).
    local_prefill_max_tokens: int = 0
    # A prompt whose full blocks the decode worker all holds (at most a block left to compute) is
    # prefilled there whatever the two settings around this one say: no hand-off for a cached prompt.
    local_prefill_cached: bool = True
    # Pending prefill tokens on the chosen prefill worker above which the decode worker
    # prefills instead (the prefill tier is saturated). 0 disables.
    prefill_queue_limit_tokens: int = 0
    # Session affinity: a worker takes one more keyed request only while it holds fewer than
    # ceil(factor * (requests + 1) / workers) of the role's requests; else the key spills to the next
    # worker on its ring (affinity.py). 1.25: Mirrokni et al.'s example; 1 keeps loads equal.
    affinity_load_factor: float = 1.25
    # "Another worker holds more of the prompt": at least this many more leading full blocks than the
    # key's worker. 1: strictly more. A larger value keeps sessions in place against small differences.
    affinity_override_blocks: int = 1
    # Peer fetch (fetch_cost.py): route where the cost is best and have that worker pull the prefix
    # from the peer holding it when that beats computing it. The two rates price a fetch.
    peer_fetch: bool = False
    peer_fetch_bandwidth_gbps: float = 2.0
    peer_fetch_prefill_tokens_per_s: float = 600.0

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        for name in ("load_weight", "request_tokens", "tie_tokens", "temperature", "restore_token_cost"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("local_prefill_max_tokens", "prefill_queue_limit_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables), got {getattr(self, name)}")
        if not math.isfinite(self.affinity_load_factor) or self.affinity_load_factor < 1:
            raise ValueError(f"affinity_load_factor must be a finite number >= 1, got {self.affinity_load_factor}")
        for name in ("peer_fetch_bandwidth_gbps", "peer_fetch_prefill_tokens_per_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if self.affinity_override_blocks < 1:
            raise ValueError(f"affinity_override_blocks must be >= 1, got {self.affinity_override_blocks}")


@dataclass(frozen=True)
class Decision:
    worker: WorkerInfo
    reason: str  # prefix_hit | load | least_load | round_robin | only_worker | most_room | affinity[_spill]
    overlap_blocks: int = 0
    cost: float = 0.0  # the policy's score for the winner (kv-aware: tokens); 0 where it has none
    fetch: FetchPlan | None = None  # peer fetch: pull these leading blocks from this holder first


class RoutingPolicy:
    name = ""

    def __init__(self, config: RouterPolicyConfig | None = None):
        self.config = config or RouterPolicyConfig(policy=self.name)
        self.rng = random.Random(self.config.seed)
        self.affinity = SessionAffinity(self.config.affinity_load_factor)

    def choose_prefill(self, workers: Sequence[WorkerInfo], block_hashes: Sequence[int], block_size: int,
                       pool: WorkerPool, index: PrefixIndex | None, exclude: Iterable[str] = (), *,
                       num_tokens: int | None = None) -> Decision:
        """Pick the prefill worker. ``num_tokens``: the prompt's length (default: its full blocks).

        Raises NoWorkerError when no candidate is left after ``exclude``.
        """
        candidates = _candidates(workers, exclude, "prefill")
        overlaps = index.overlaps(block_hashes) if index is not None else {}
        if num_tokens is None:
            num_tokens = len(block_hashes) * block_size
        if len(candidates) == 1:
            only = candidates[0]
            return Decision(only, "only_worker", overlaps.get(only.worker_id, 0))
        decision = self._pick_prefill(candidates, overlaps, num_tokens, block_size, pool, block_hashes, index)
        if self.config.peer_fetch:
            w = decision.worker
            uncached = self._uncached(w, overlaps.get(w.worker_id, 0), num_tokens, block_size, block_hashes, index)
            plan = self._fetch_plan(w, candidates, overlaps, num_tokens, block_size, pool, block_hashes, index,
                                    uncached)
            if plan is not None:
                decision = Decision(w, decision.reason, decision.overlap_blocks, decision.cost, plan)
        return decision

    def _uncached(self, w: WorkerInfo, overlap: int, num_tokens: int, block_size: int,
                  block_hashes: Sequence[int], index: PrefixIndex | None) -> float:
        """Prompt tokens ``w`` computes, a block in its spill tier counting ``restore_token_cost``."""
        uncached = max(0, num_tokens - overlap * block_size)
        if overlap and index is not None:  # blocks in its spill tier: a copy back, not free
            uncached += self.config.restore_token_cost * block_size * index.spilled_run(
                w.worker_id, block_hashes, overlap)
        return uncached

    def _fetch_plan(self, w: WorkerInfo, candidates: Sequence[WorkerInfo], overlaps: dict[str, int],
                    num_tokens: int, block_size: int, pool: WorkerPool, block_hashes: Sequence[int],
                    index: PrefixIndex | None, uncached: float) -> FetchPlan | None:
        c = self.config
        if not c.peer_fetch:
            return None
        holders = [h for h in candidates if overlaps.get(h.worker_id, 0) > overlaps.get(w.worker_id, 0)]
        if not holders:
            return None
        spilled = {h.worker_id: index.spilled_run(h.worker_id, block_hashes, overlaps[h.worker_id])
                   for h in holders} if index is not None else {}
        pending = {h.worker_id: pool.load(h.worker_id).pending_prefill_tokens for h in holders}
        # the rate this worker's fetches measured (heartbeated), else the configured bandwidth
        bandwidth = w.kv_fetch_bytes_per_s or c.peer_fetch_bandwidth_gbps * 1e9
        return plan_fetch(w, holders, overlaps, spilled, pending, num_tokens, block_size, uncached,
                          bandwidth, c.peer_fetch_prefill_tokens_per_s, c.restore_token_cost)

    def _pick_prefill(self, candidates: list[WorkerInfo], overlaps: dict[str, int], num_tokens: int,
                      block_size: int, pool: WorkerPool, block_hashes: Sequence[int],
                      index: PrefixIndex | None) -> Decision:
        raise NotImplementedError

    def choose_decode(self, workers: Sequence[WorkerInfo], num_blocks_needed: int, pool: WorkerPool,
                      exclude: Iterable[str] = (), *, session_key: str = "", block_hashes: Sequence[int] = (),
                      index: PrefixIndex | None = None) -> Decision:
        """Pick a decode worker with ``num_blocks_needed`` free KV blocks. With a ``session_key``,
        the prompt's ``block_hashes`` and the ``index`` tell which workers hold more of it.

        Raises NoWorkerError when no candidate is left, CapacityError when none has room.
        """
        candidates = _candidates(workers, exclude, "decode")
        if not session_key and len(candidates) > 1:
            # The policy's order, read only until two workers fit: the first is the choice, a second
            # says it was a choice (one alone is "most_room")
            fits, load_of = [], pool.load
            for w in self._decode_order(candidates, pool):
                if load_of(w.worker_id).kv_blocks_free >= num_blocks_needed:
                    fits.append(w)
                    if len(fits) == 2:
                        return self._decided_decode(fits[0], pool)
            if fits:
                return Decision(fits[0], "most_room")
        loads, fits, load_of = {}, [], pool.load
        for w in candidates:
            load = loads[w.worker_id] = load_of(w.worker_id)
            if load.kv_blocks_free >= num_blocks_needed:
                fits.append(w)
        if not fits:
            roomiest = max(candidates, key=lambda w: loads[w.worker_id].kv_blocks_free)
            largest = max(w.kv_blocks_total for w in candidates)
            hint = (f"it exceeds every worker's whole cache (largest: {largest} blocks)"
                    if num_blocks_needed > largest else "retry later")
            raise CapacityError(
                f"no decode worker has {num_blocks_needed} free KV blocks for this request "
                f"(most free: {loads[roomiest.worker_id].kv_blocks_free} on {roomiest.worker_id}, "
                f"{len(candidates)} worker(s) considered); {hint}")
        if len(candidates) == 1:
            return Decision(fits[0], "only_worker")
        if len(fits) == 1:
            return Decision(fits[0], "most_room")
        overlaps = index.overlaps(block_hashes) if index is not None and block_hashes else {}
        worker, reason, overlap = self.affinity.choose(
            session_key, "decode", workers, fits, {w.worker_id: loads[w.worker_id].active_requests for w in fits},
            overlaps, self.config.affinity_override_blocks)
        return Decision(worker, reason, overlap)

    def _decode_order(self, candidates: list[WorkerInfo], pool: WorkerPool) -> Iterator[WorkerInfo]:
        """The decode candidates, preferred first: fewest requests, then most free blocks, then by id
        (``WorkerLoad.decode_rank``), read from the pool's ranking rather than every worker's load."""
        yield from _ranked(candidates, pool, "decode", _DECODE_RANK)

    def _decided_decode(self, worker: WorkerInfo, pool: WorkerPool) -> Decision:
        return Decision(worker, "least_load", cost=pool.load(worker.worker_id).num_requests)


class KVAwarePolicy(RoutingPolicy):
    name = "kv-aware"

    def cost(self, load: WorkerLoad, uncached_tokens: int) -> float:
        return uncached_tokens + self.load_cost(load)

    def load_cost(self, load: WorkerLoad) -> float:
        """The cost's load part, in prompt tokens: the same for every prompt, so the pool keeps the
        workers ranked by it (a worker without the prefix costs the prompt's length plus this)."""
        # The router's own in-flight counts are exact and current; the heartbeat is up to a second
        # old, counts the same requests again, and counts a waiting request's whole prompt (its
        # prefix hit is only known at admission), so it overstates the worker that holds a hot
        # prefix. The larger of the two keeps other routers' load visible without adding them up.
        c = self.config
        return c.load_weight * max(load.queued_prefill_tokens, load.inflight_prefill_tokens) \
            + c.request_tokens * load.active_requests

    def _pick_prefill(self, candidates, overlaps, num_tokens, block_size, pool, block_hashes, index):
        # The eviction charge only adds to a worker's cost, so it is computed in order of the cost
        # without it, and only while that could still make the worker the best (or a near-tie):
        # with hundreds of workers most are ruled out by their load alone, the same choice at a
        # fraction of the work (the charge walks the worker's cache model).
        margin = self.config.tie_tokens if self.config.temperature > 0 else 0.0
        scored = []  # (cost, worker id, worker, overlap)
        best = math.inf
        for cost, i, w, overlap in self._base_costs(candidates, overlaps, num_tokens, block_size, pool,
                                                    block_hashes, index):
            if cost > best + margin:
                break
            if index is not None and w.kv_blocks_total > 0:  # 0: the worker has not reported its cache yet
                cost += block_size * index.reused_evictions(w.worker_id, block_hashes, w.kv_cache_capacity)
            scored.append((cost, i, w, overlap))
            best = min(best, cost)
        scored = [(cost, w, overlap) for cost, _, w, overlap in sorted(scored, key=lambda s: s[1])]
        if self.config.temperature == 0:
            cost, worker, overlap = next(s for s in scored if s[0] == best)
        else:
            near = [s for s in scored if s[0] <= best + self.config.tie_tokens]
            scale = self.config.temperature * max(self.config.tie_tokens, 1.0)
            weights = [math.exp(-(s[0] - best) / scale) for s in near]
            cost, worker, overlap = self.rng.choices(near, weights=weights)[0]
        return Decision(worker, "prefix_hit" if overlap > 0 else "load", overlap, cost)

    def _base_costs(self, candidates, overlaps, num_tokens, block_size, pool, block_hashes, index):
        """(cost without the eviction charge, worker id, worker, overlap), cheapest first (then by id),
        lazily. The workers holding none of the prompt cost its length plus their load cost, so they
        come from the pool's ranking by load cost, merged with the holders (few), costed here."""
        view = _pool_view(candidates, pool, "prefill", self.load_cost)
        if view is not None and not self.config.peer_fetch and not (index is not None and index.has_spilled()):
            # the common case, inlined (hundreds of holders of a popular prefix at 1,000 workers):
            # cost = uncached + load cost, the load cost read from the ranking
            ranking, by_id = view
            held = []
            for worker_id, overlap in overlaps.items():
                w = by_id.get(worker_id)
                if w is not None and overlap > 0:
                    held.append((max(0, num_tokens - overlap * block_size) + ranking.key_of(worker_id), worker_id,
                                 w, overlap))
            held.sort(key=_FIRST_TWO)  # ids are unique: never compares workers
            return heapq.merge(held, self._unheld(ranking, by_id, overlaps, num_tokens), key=_FIRST_TWO)
        cost, load_of = self.cost, pool.load
        holders = [w for w in candidates if overlaps.get(w.worker_id, 0) > 0]
        if self.config.peer_fetch:  # a fetch plan can lower any worker's cost: cost every one
            holders = candidates
        held = []
        for w in holders:
            overlap = overlaps.get(w.worker_id, 0)
            uncached = self._uncached(w, overlap, num_tokens, block_size, block_hashes, index)
            plan = self._fetch_plan(w, candidates, overlaps, num_tokens, block_size, pool, block_hashes, index,
                                    uncached)
            if plan is not None:  # fetching the prefix here beats computing it (the third choice)
                uncached = plan.cost
            held.append((cost(load_of(w.worker_id), uncached), w.worker_id, w, overlap))
        held.sort(key=_FIRST_TWO)  # ids are unique: never compares workers
        if len(held) == len(candidates):
            return held
        held_ids = {h[1] for h in held}
        others = ((num_tokens + load_cost, w.worker_id, w, 0)
                  for load_cost, w in _ranked_keys(candidates, pool, "prefill", self.load_cost)
                  if w.worker_id not in held_ids)
        return heapq.merge(held, others, key=_FIRST_TWO)

    @staticmethod
    def _unheld(ranking: LoadRanking, by_id: dict[str, WorkerInfo], overlaps: dict[str, int], num_tokens: int):
        for load_cost, worker_id in ranking.ordered():
            w = by_id.get(worker_id)
            if w is not None and not overlaps.get(worker_id, 0) > 0:
                yield num_tokens + load_cost, worker_id, w, 0


class LeastLoadPolicy(RoutingPolicy):
    name = "least-load"

    def _pick_prefill(self, candidates, overlaps, num_tokens, block_size, pool, block_hashes, index):
        # the fewest pending prefill tokens, then the fewest requests, then the lowest id
        best = next(_ranked(candidates, pool, "prefill", _LEAST_PREFILL))
        return Decision(best, "least_load", overlaps.get(best.worker_id, 0),
                        pool.load(best.worker_id).pending_prefill_tokens)


class RoundRobinPolicy(RoutingPolicy):
    """Cycles by worker id, resuming after the last one chosen, so joins and leaves keep the rotation fair."""

    name = "round-robin"

    def __init__(self, config: RouterPolicyConfig | None = None):
        super().__init__(config)
        self._last: dict[str, str] = {}  # role -> last worker id chosen

    def _next(self, role: str, workers: list[WorkerInfo]) -> WorkerInfo:
        last = self._last.get(role)
        # workers are in id order: the first after the last one chosen (a binary search), else the first
        i = 0 if last is None else bisect.bisect_right(workers, last, key=_BY_ID)
        chosen = workers[i] if i < len(workers) else workers[0]
        self._last[role] = chosen.worker_id
        return chosen

    def _pick_prefill(self, candidates, overlaps, num_tokens, block_size, pool, block_hashes, index):
        chosen = self._next("prefill", candidates)
        return Decision(chosen, "round_robin", overlaps.get(chosen.worker_id, 0))

    def _decode_order(self, candidates, pool):
        # the rotation: after the last one chosen, then from the start
        last = self._last.get("decode")
        if last is None:
            return iter(candidates)
        start = bisect.bisect_right(candidates, last, key=_BY_ID)
        return itertools.chain(candidates[start:], candidates[:start])

    def _decided_decode(self, worker, pool):
        self._last["decode"] = worker.worker_id
        return Decision(worker, "round_robin")


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (KVAwarePolicy, LeastLoadPolicy, RoundRobinPolicy)}


def make_policy(name: str, **config) -> RoutingPolicy:
    """The policy called ``name``, configured by ``RouterPolicyConfig`` fields given as keywords."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    known = {f.name for f in fields(RouterPolicyConfig)} - {"policy"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown routing policy option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return POLICIES[name](RouterPolicyConfig(policy=name, **config))


def policy_from_config(config: RouterPolicyConfig) -> RoutingPolicy:
    return POLICIES[config.policy](config)


def decode_is_busy(load: WorkerLoad, config: RouterPolicyConfig) -> bool:
    """Too busy to take a local prefill: requests already wait there, or it already has a full
    local-prefill allowance of prompt tokens pending (local prefills stall its decode batch)."""
    return load.num_waiting > 0 or load.pending_prefill_tokens >= max(config.local_prefill_max_tokens, 1)


def should_prefill_locally(uncached_tokens: int, prefill_queue_tokens: int, has_prefill_workers: bool,
                           config: RouterPolicyConfig, *, decode_busy: bool = False) -> bool:
    """Conditional disaggregation: run this prompt's prefill on its decode worker?

    ``uncached_tokens``: prompt tokens the decode worker would compute (its own cache
    considered). ``prefill_queue_tokens``: pending prefill tokens on the prefill worker the
    request would otherwise go to. ``decode_busy``: see ``decode_is_busy``.

    Yes when there is no prefill worker; when the prompt is short enough
    (``local_prefill_max_tokens``, 0 disables) and the decode worker is not busy, as the
    hand-off's round trip would cost more than the compute; or when the prefill tier is
    saturated (``prefill_queue_limit_tokens``, 0 disables), as waiting in that queue costs
    more than slowing the decode batch.
    """
    if not has_prefill_workers:
        return True
    if 0 < config.local_prefill_max_tokens and uncached_tokens <= config.local_prefill_max_tokens \
            and not decode_busy:
        return True
    return 0 < config.prefill_queue_limit_tokens < prefill_queue_tokens


_BY_ID = operator.attrgetter("worker_id")
_FIRST_TWO = operator.itemgetter(0, 1)
# the pool keeps a ranking per key object: these are module constants so every call names the same one
_DECODE_RANK = operator.attrgetter("decode_rank")
_LEAST_PREFILL = operator.attrgetter("pending_prefill_tokens", "num_requests")


def _pool_view(candidates: list[WorkerInfo], pool: WorkerPool, role: str,
               key: Callable[[WorkerLoad], object]) -> tuple[LoadRanking, dict[str, WorkerInfo]] | None:
    """The pool's ranking of ``role`` by ``key`` and the candidates by id, when the ranking holds every
    candidate (the usual case: they are the pool's own ready workers of the role); else None."""
    ranking = pool.ranked(role, key)
    ready = pool.ready_by_id(role)
    if _is_ready_list(candidates, pool, role):
        return ranking, ready
    if len(candidates) == len(ready) and all(map(operator.is_, candidates, ready.values())):
        return ranking, ready  # the same objects in the same order: no dict to build per request
    by_id = {w.worker_id: w for w in candidates}
    return (ranking, by_id) if by_id.keys() <= ranking.members() else None


def _ranked_keys(candidates: list[WorkerInfo], pool: WorkerPool, role: str,
                 key: Callable[[WorkerLoad], object]) -> Iterator[tuple[object, WorkerInfo]]:
    """(key(load), worker) for ``candidates``, lowest key first, then by id: from the pool's ranking,
    read only as far as the caller goes, or (candidates it does not rank) every load, sorted here."""
    view = _pool_view(candidates, pool, role, key)
    if view is not None:
        ranking, by_id = view
        for k, worker_id in ranking.ordered():
            w = by_id.get(worker_id)
            if w is not None:
                yield k, w
        return
    keyed = [(key(pool.load(w.worker_id)), w.worker_id, w) for w in candidates]
    keyed.sort(key=_FIRST_TWO)
    for k, _, w in keyed:
        yield k, w


def _ranked(candidates: list[WorkerInfo], pool: WorkerPool, role: str,
            key: Callable[[WorkerLoad], object]) -> Iterator[WorkerInfo]:
    return (w for _, w in _ranked_keys(candidates, pool, role, key))


def _is_ready_list(workers: Sequence[WorkerInfo], pool: WorkerPool, role: str) -> bool:
    return isinstance(workers, ReadyWorkers) and workers.pool is pool and workers.role == role \
        and workers.generation == pool.generation


def _candidates(workers: Sequence[WorkerInfo], exclude: Iterable[str], role: str) -> list[WorkerInfo]:
    excluded = set(exclude)
    if not excluded and isinstance(workers, ReadyWorkers) and workers:
        return workers  # the pool's list, in id order already (read only: policies never change it)
    # attrgetter, not a lambda: this runs per request over every worker of the role
    candidates = sorted((w for w in workers if w.worker_id not in excluded) if excluded else workers, key=_BY_ID)
    if not candidates:
        detail = f" ({len(excluded)} excluded after failing)" if excluded and workers else ""
        raise NoWorkerError(f"no {role} worker is available{detail}")
    return candidates
