"""Which worker holds which KV block: a global index built from the KV-event stream.

Two maps kept in step: block hash -> holders (what a lookup walks) and
worker -> hashes (so forgetting a worker costs its own blocks, not the index).
A worker's hashes are kept in the order this router last sent it a prompt using
them, least recent first, with how many such prompts there were: a model of the
worker's LRU cache, from which ``reused_evictions`` estimates what a new prompt
would push out of it (see ``touch``).
Block hashes are chained (``services.engine.block_hash``), so a prompt's blocks
are only useful to a worker as a *leading* run: a hit on block k without blocks
0..k-1 cannot be served from cache, so overlap stops at the first miss.

Tiers: a worker with a spill tier reports blocks that left its pool for it (``"s"`` runs with
tier ``"spill"``). They stay held here, marked spilled (``spilled_run``): a hit on them costs a
copy back instead of a recompute, more than a pool hit and far less than computing them.

The index is advisory. It lags the workers by the stream's latency and may
under- or over-count after trims (events a worker failed to publish are
resynced: kv_events.Publisher); a wrong guess costs a cache
hit or a slightly worse placement, never a wrong answer (a worker verifies
every hit against its stored tokens).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.kv_events import CLEARED, REMOVED, SPILL, STORED, STREAM_KEY, decode_entry
from services.loops import Loops

log = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash -> worker ids
        # worker id -> {block hash: prompts routed there that used it}, least recently routed first
        self._blocks: dict[str, OrderedDict[int, int]] = {}
        self._spilled: dict[str, set[int]] = {}  # worker id -> its held hashes that are in its spill tier

    def apply(self, worker_id: str, runs: Iterable[tuple]) -> None:
        """Apply one publish's ``(kind, hashes[, tier])`` runs in order. Unknown kinds are skipped."""
        for kind, hashes, *tier in runs:
            if kind == STORED:
                self._store(worker_id, hashes)
                if tier and tier[0] == SPILL:
                    self._spilled.setdefault(worker_id, set()).update(hashes)
                elif spilled := self._spilled.get(worker_id):
                    spilled.difference_update(hashes)
            elif kind == REMOVED:
                self._remove(worker_id, hashes)
            elif kind == CLEARED:
                self.drop_worker(worker_id)
            else:
                log.warning("unknown KV event kind %r from %s", kind, worker_id)

    def _store(self, worker_id: str, hashes: Sequence[int]) -> None:
        mine = self._blocks.setdefault(worker_id, OrderedDict())
        for h in hashes:
            if h not in mine:
                mine[h] = 1  # computed for one request (ours, touched already, or another router's)
                self._holders.setdefault(h, set()).add(worker_id)

    def touch(self, worker_id: str, hashes: Sequence[int], capacity: int = 0) -> None:
        """A prompt with these full blocks was just routed to ``worker_id``: it will hold them
        (the prediction the worker's KV events confirm, or correct with removals, milliseconds
        later), as its most recently used blocks, the first block most recent of all (a worker
        frees a prompt's blocks tail first), and each has served one more prompt.

        ``capacity`` (the worker's KV blocks; 0: unknown): a worker holds no more, so blocks
        beyond it, least recently used first, are forgotten; this also drops predictions that
        never came true (a request that failed before its blocks were stored)."""
        mine = self._blocks.setdefault(worker_id, OrderedDict())
        spilled = self._spilled.get(worker_id)
        if spilled:  # (an empty set's difference_update still walks the hashes: this runs per request)
            spilled.difference_update(hashes)  # a hit restores them into its pool
        pop, holders = mine.pop, self._holders
        for h in reversed(hashes):
            uses = pop(h, 0)
            mine[h] = uses + 1
            if not uses:
                holders.setdefault(h, set()).add(worker_id)
        while 0 < capacity < len(mine):
            h, _ = mine.popitem(last=False)
            self._unhold(worker_id, h)

    def reused_evictions(self, worker_id: str, hashes: Sequence[int], capacity: int) -> int:
        """How many blocks that served more than one prompt ``worker_id`` would evict to make room
        for the blocks of ``hashes`` it lacks, its least recently used first, given ``capacity``
        blocks of cache. Such blocks are likely wanted again (a shared prefix), so evicting one
        costs a recompute later; a block used once (a prompt's own suffix) costs nothing."""
        mine = self._blocks.get(worker_id) or OrderedDict()
        free = max(0, capacity - len(mine))
        if len(hashes) <= free:  # room for the whole prompt: nothing goes (the common case, and O(1))
            return 0
        wanted = set(hashes)
        evict = len(wanted) - len(mine.keys() & wanted) - free
        reused = 0
        for h, uses in mine.items():  # least recently used first
            if evict <= 0:
                break
            if h in wanted:
                continue  # this prompt uses it: refreshed, not evicted
            reused += uses > 1
            evict -= 1
        return reused

    def _remove(self, worker_id: str, hashes: Sequence[int]) -> None:
        mine = self._blocks.get(worker_id)
        if mine is None:
            return
        for h in hashes:
            if mine.pop(h, None) is not None:
                self._unhold(worker_id, h)
        if not mine:
            del self._blocks[worker_id]

    def _unhold(self, worker_id: str, h: int) -> None:
        spilled = self._spilled.get(worker_id)
        if spilled:
            spilled.discard(h)
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]

    def drop_worker(self, worker_id: str) -> None:
        """Forget everything ``worker_id`` held (it cleared its cache, died or left)."""
        for h in self._blocks.pop(worker_id, ()):
            self._unhold(worker_id, h)
        self._spilled.pop(worker_id, None)

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt ``worker_id`` holds."""
        mine = self._blocks.get(worker_id)
        if not mine:
            return 0
        n = 0
        for h in block_hashes:
            if h not in mine:
                break
            n += 1
        return n

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading-block overlap of every worker that holds at least the first block.

        Walks the prompt once, narrowing the set of workers that held every block
        so far; a worker leaves the set at its first miss with the count so far,
        and the walk stops once the set is empty. Workers absent from the answer have 0.
        """
        # (per request over every block of the prompt: no set is built for a block every holder still holds)
        result: dict[str, int] = {}
        holders = self._holders.get(block_hashes[0]) if block_hashes else None
        if not holders:
            return result
        alive = set(holders)
        for n in range(1, len(block_hashes)):
            holders = self._holders.get(block_hashes[n])
            if holders is None:
                still = set()
            elif alive <= holders:  # every worker still in the walk holds this block too: nothing to build
                continue
            else:
                still = alive & holders
            for worker_id in alive - still:
                result[worker_id] = n
            alive = still
            if not alive:
                return result
        for worker_id in alive:  # held the whole prompt
            result[worker_id] = len(block_hashes)
        return result

    def spilled_run(self, worker_id: str, block_hashes: Sequence[int], overlap: int) -> int:
        """Of the first ``overlap`` blocks of the prompt (a leading run ``worker_id`` holds), how many
        are in its spill tier rather than its pool."""
        spilled = self._spilled.get(worker_id)
        if not spilled:
            return 0
        return sum(1 for h in block_hashes[:overlap] if h in spilled)

    def has_spilled(self) -> bool:
        """Whether any worker holds blocks in a spill tier (a policy can skip pricing restores if not)."""
        return any(self._spilled.values())

    def num_spilled(self, worker_id: str) -> int:
        return len(self._spilled.get(worker_id, ()))

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def workers(self) -> list[str]:
        """Ids of every worker the index holds blocks for."""
        return sorted(self._blocks)

    def __len__(self) -> int:
        """Distinct block hashes held by anyone."""
        return len(self._holders)


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(reply) -> list:
    """One stream's XREAD reply -> [(id, fields)], whichever shape the client's protocol gives:
    RESP2 ``[[stream, entries]]``, RESP3 ``{stream: [entries]}`` or ``{stream: entries}``."""
    groups = reply.values() if isinstance(reply, dict) else (group[1] for group in reply)
    out: list = []
    for entries in groups:
        if entries and isinstance(entries[0], list) and entries[0] and isinstance(entries[0][0], (list, tuple)):
            entries = entries[0]
        out.extend(entries)
    return out


class KVEventFollower:
    """Keeps a ``PrefixIndex`` in step with the ``pd:kv-events`` stream.

    Reads the stream from its start (the index is rebuilt on every router start),
    then follows it with blocking reads. Redis errors are logged and retried with
    backoff from ``last_id``, so nothing is applied twice or skipped (bar entries
    trimmed meanwhile, which the stream's cap allows).
    """

    def __init__(self, redis, index: PrefixIndex, *, stream: str = STREAM_KEY, block_ms: int = 1000,
                 batch: int = 500, max_backoff_s: float = 5.0):
        self.redis = redis
        self.index = index
        self.stream = stream
        self.block_ms = block_ms
        self.batch = batch
        self.max_backoff_s = max_backoff_s
        self.last_id = "0"
        self.entries_applied = 0
        self._target: tuple[int, int] | None = None  # the stream's last entry id when we started
        self._caught_up = asyncio.Event()
        self._loops = Loops()

    @property
    def running(self) -> bool:
        return self._loops.running

    async def start(self) -> None:
        self._loops.start({"kv-event-follower": self._run})

    async def stop(self) -> None:
        await self._loops.stop(self.block_ms / 1000 + 0.5)  # a blocked read returns within block_ms

    async def caught_up(self, timeout: float | None = None) -> bool:
        """True once everything in the stream at start has been applied; False on timeout."""
        try:
            await asyncio.wait_for(self._caught_up.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def is_caught_up(self) -> bool:
        return self._caught_up.is_set()

    async def _learn_target(self) -> None:
        # XREVRANGE, not XINFO's last-generated-id: that id may belong to a deleted
        # entry we could never read, and we would wait for it forever.
        last = await self.redis.xrevrange(self.stream, count=1)
        if not last:
            self._caught_up.set()  # empty or missing stream: nothing to rebuild
        else:
            self._target = _parse_id(_text(last[0][0]))
        self._check_caught_up()

    def _check_caught_up(self) -> None:
        if self._target is not None and self.last_id != "0" and _parse_id(self.last_id) >= self._target:
            self._caught_up.set()

    async def _run(self) -> None:
        backoff = 0.1
        while not self._loops.stopping:
            try:
                if not self._caught_up.is_set() and self._target is None:
                    await self._learn_target()
                reply = await self.redis.xread({self.stream: self.last_id}, count=self.batch, block=self.block_ms)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reading %s failed (retrying in %.1fs from %s): %s", self.stream, backoff,
                            self.last_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            if not reply:
                # A blocking read that timed out empty: we are at the end, whatever the target said
                # (the target entry may have been trimmed away under us).
                if self._target is not None:
                    self._caught_up.set()
                continue
            for entry_id, fields in _entries(reply):
                self._apply(fields)
                self.last_id = _text(entry_id)
            self._check_caught_up()

    def _apply(self, fields: dict) -> None:
        try:
            worker_id, runs = decode_entry(fields)
        except Exception as exc:  # a malformed entry must not stop the follower
            log.warning("skipping malformed KV event entry: %s", exc)
            return
        self.index.apply(worker_id, runs)
        self.entries_applied += 1
