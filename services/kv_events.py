"""KV events on a Redis stream: workers publish what their prefix caches store and evict.

Stream ``pd:kv-events``; one entry per publish with fields ``worker`` (its id)
and ``events``, a JSON list of ``[kind, [block hashes]]`` in the order they
happened: ``"s"`` stored, ``"r"`` removed, ``"c"`` cleared (the worker started
with an empty cache, or reset it: forget everything it had). Routers read the
stream from the beginning to rebuild their prefix index, then follow it. The
stream is capped (approximately) at ``MAXLEN`` entries; a router that starts
after old entries were trimmed under-counts those blocks, which costs cache
hits, never correctness (a worker verifies every hit against stored tokens).

A publish that fails (Redis away or refusing the write) loses its events, so
routers' indexes would miss those blocks until they were evicted. Instead the
worker's next publish that goes through is a resync (``Publisher``): ``"c"``
then ``"s"`` with every block its cache holds, read in the same engine-thread
call that drains the events it replaces, so every index converges to the cache
as it is. Nothing is queued meanwhile: an outage of any length costs one
message, of the cache's size.

Tiers (a worker with a spill tier, ``--kv-spill-gb``): a run may carry a third element, the
tier its blocks are in now: ``["s", [hashes], "spill"]`` says the blocks left the worker's pool
for its spill tier (they are still there, restored on a hit instead of recomputed); ``"s"``
without a tier is the pool, and storing a hash in one tier takes it out of the other. ``"r"``
removes a block from whichever tier held it (the tier, when given, is informational).
"""

from __future__ import annotations

import json
import logging
from typing import Iterable

from services.engine.block_pool import POOL, SPILL, BlockStored, KVEvent

log = logging.getLogger(__name__)
STREAM_KEY = "pd:kv-events"
MAXLEN = 1_000_000

STORED, REMOVED, CLEARED = "s", "r", "c"


def encode(events: Iterable[KVEvent]) -> list[list]:
    """Engine events -> ``[kind, hashes]`` runs (adjacent events of one kind merged)."""
    runs: list[list] = []
    for event in events:
        kind = STORED if isinstance(event, BlockStored) else REMOVED
        tier = [] if event.tier == POOL else [event.tier]
        if runs and runs[-1][0] == kind and runs[-1][2:] == tier:
            runs[-1][1].extend(event.block_hashes)
        else:
            runs.append([kind, list(event.block_hashes), *tier])
    return runs


async def publish(redis, worker_id: str, runs: list[list]) -> None:
    if runs:
        await redis.xadd(STREAM_KEY, {"worker": worker_id, "events": json.dumps(runs)},
                         maxlen=MAXLEN, approximate=True)


async def publish_cleared(redis, worker_id: str) -> None:
    await publish(redis, worker_id, [[CLEARED, []]])


def decode_entry(fields: dict) -> tuple[str, list[tuple]]:
    """A stream entry's fields -> (worker id, [(kind, hashes) or (kind, hashes, tier)])."""
    get = lambda k: fields.get(k, fields.get(k.encode()))  # noqa: E731 (bytes or str keys)
    worker = get("worker")
    events = get("events")
    worker = worker.decode() if isinstance(worker, bytes) else worker
    return worker, [tuple(run) for run in json.loads(events)]


class Publisher:
    """One worker's publishing: its events, or after a failed publish, a resync.

    Each interval the worker drains its cache's events and, when ``resync`` is set, the hashes
    its cache holds, in one call on the engine thread, then hands both to ``publish``.
    """

    def __init__(self, redis, worker_id: str):
        self.redis = redis
        self.worker_id = worker_id
        self.resync = False  # a publish failed: the next one that goes through replaces what was lost
        self.resyncs = 0

    async def publish(self, events: Iterable[KVEvent], cached: list[int] | None,
                      spilled: list[int] | None = None) -> None:
        """``cached``: every block hash the cache holds, taken with ``events`` (only while ``resync``);
        ``spilled``: those its spill tier holds, taken with them."""
        runs = [[CLEARED, []], [STORED, list(cached)]] if cached is not None else encode(events)
        if cached is not None and spilled:
            runs.append([STORED, list(spilled), SPILL])
        try:
            await publish(self.redis, self.worker_id, runs)
        except Exception as exc:
            if not self.resync:  # one line per outage, not one per interval
                log.warning("publishing KV events failed (%s); the next publish resyncs the routers' index", exc)
            self.resync = True
            return
        if cached is not None:
            self.resync = False
            self.resyncs += 1
            log.info("KV events resynced: %d cached blocks", len(cached))
