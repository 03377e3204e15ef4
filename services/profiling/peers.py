"""Where a fan-out profile finds the other processes of a stack.

Workers are in the registry already (their gRPC server serves Admin too). The
router and the gateway have no registry entry, so each advertises its admin gRPC
address under ``pd:admin:{process_id}`` (a key with a TTL, listed in the set
``pd:admins``), refreshed while it runs: a process that dies drops out by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass

from services.registry import read_workers

log = logging.getLogger(__name__)
ADMINS_KEY = "pd:admins"
_TTL_MS = 10_000
_INTERVAL_S = 3.0


@dataclass(frozen=True)
class Peer:
    role: str
    process_id: str
    address: str


def new_process_id(role: str) -> str:
    """Like a worker id (services/registry.py), for the processes that have none."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _key(process_id: str) -> str:
    return f"pd:admin:{process_id}"


class AdminAdvert:
    """Keeps one process's admin address in Redis while it runs (``start`` / ``stop``)."""

    def __init__(self, redis, peer: Peer):
        self.redis, self.peer = redis, peer
        self._task: asyncio.Task | None = None

    async def beat(self) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(_key(self.peer.process_id), json.dumps(self.peer.__dict__), px=_TTL_MS)
            pipe.sadd(ADMINS_KEY, self.peer.process_id)
            await pipe.execute()

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.create_task(self._run(), name="admin-advert")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(_INTERVAL_S)
            try:
                await self.beat()
            except Exception as exc:  # Redis away for a moment: the TTL decides
                log.warning("admin advert failed: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(_key(self.peer.process_id))
                pipe.srem(ADMINS_KEY, self.peer.process_id)
                await pipe.execute()
        except Exception as exc:
            log.warning("admin advert removal failed (it expires by itself): %s", exc)


async def find_peers(redis, self_id: str) -> list[Peer]:
    """Every live worker, router and gateway of the stack but the caller."""
    peers = [Peer(w.role, w.worker_id, w.address) for w in await read_workers(redis)]
    ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await redis.smembers(ADMINS_KEY))
    values = await redis.mget([_key(i) for i in ids]) if ids else []
    gone = []
    for process_id, value in zip(ids, values):
        if value is None:
            gone.append(process_id)
        else:
            peers.append(Peer(**json.loads(value)))
    if gone:
        await redis.srem(ADMINS_KEY, *gone)
    return [p for p in peers if p.process_id != self_id]
