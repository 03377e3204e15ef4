"""The worker registry in Redis: workers heartbeat what they are and how loaded; routers read it.

Each worker owns one key, ``pd:worker:<id>`` (a JSON ``WorkerInfo``), rewritten
every heartbeat with a TTL, and adds its id to the set ``pd:workers``. A worker
that dies stops heartbeating and its key expires, so it leaves every router's
pool within the TTL; readers drop ids whose key is gone from the set. A worker
that drains deregisters at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

from services.errors import ServiceUnavailableError

log = logging.getLogger(__name__)

WORKERS_KEY = "pd:workers"
# pub/sub: every heartbeat's entry as it is written, and {"worker_id": ..., "left": true} when a worker deregisters,
# so routers learn of a change at once instead of re-reading the registry every few hundred ms (worker_pool.py)
CHANGES_CHANNEL = "pd:workers:changes"
ROLES = ("prefill", "decode")


REDIS_CONNECT_TIMEOUT_S = 5.0
# How long one command's reply may take before redis-py gives up on the connection (TimeoutError). redis-py 8
# made this 5 s by default (it had been no limit): on a loaded machine a pipelined write of an engine step's
# chunks can wait that long for a starved Redis, and the worker failed the requests whose chunks they were. A
# blocking read (XREAD BLOCK, at most a few seconds here) must stay well under it.
REDIS_SOCKET_TIMEOUT_S = 30.0
REDIS_MAX_CONNECTIONS = 100  # per process; the gateway's is its --redis-max-connections
REDIS_POOL_TIMEOUT_S = 10.0


def redis_client_options(name: str = "") -> dict:
    """The socket options of every Redis client pdserve opens (``redis.Redis.from_url(url, **options)``);
    ``name`` becomes its CLIENT SETNAME, suffixed with the pid."""
    options = {"socket_timeout": REDIS_SOCKET_TIMEOUT_S, "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S}
    if name:
        options["client_name"] = f"{name}-{os.getpid()}"
    return options


async def connect_redis(url: str, *, max_connections: int = REDIS_MAX_CONNECTIONS,
                        pool_timeout_s: float = REDIS_POOL_TIMEOUT_S, name: str = ""):
    """A ``redis.asyncio`` client for ``url`` that has answered a PING. Nothing answering there is
    a ServiceUnavailableError naming the URL (the CLI prints it and exits 1), not a traceback
    from the first command some time later; a malformed URL is redis-py's ValueError.

    The client opens at most ``max_connections`` connections: a command that finds them all
    busy waits for one, in arrival order (up to ``pool_timeout_s``, then redis-py's ConnectionError, which the
    gateway answers as 503 + Retry-After) instead of failing at once as redis-py's default
    pool does. ``name`` (CLIENT SETNAME, suffixed with the pid) tells the processes apart in
    Redis's CLIENT LIST.
    """
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    if type(max_connections) is not int or max_connections < 2:
        raise ValueError(f"max_connections must be an int >= 2; got {max_connections!r}")
    if not pool_timeout_s > 0:
        raise ValueError(f"pool_timeout_s must be > 0; got {pool_timeout_s!r}")
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    # a pooled connection that Redis closed (a restart, a failover, CLIENT KILL) fails its next command:
    # reconnect and send it again, twice at most (the queue's writes are idempotent on the request id)
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), 2)
    from services.fair_pool import FairConnectionPool

    # first come, first served: redis-py's own blocking pool lets newcomers overtake a waiting command until it
    # times out (fair_pool.py)
    pool = FairConnectionPool.from_url(url, max_connections=max_connections, timeout=pool_timeout_s, retry=retry,
                                       **redis_client_options(name))
    client = aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it
    try:
        await asyncio.wait_for(client.ping(), REDIS_CONNECT_TIMEOUT_S)
    except (RedisError, OSError, asyncio.TimeoutError) as exc:
        await client.aclose()
        reason = str(exc) or f"no answer in {REDIS_CONNECT_TIMEOUT_S:.0f} s"
        raise ServiceUnavailableError(f"cannot reach Redis at {url}: {reason} (`pdserve up` starts an embedded "
                                      "server; otherwise start one or give its address with --redis-url)") from None
    return client


def worker_key(worker_id: str) -> str:
    return f"pd:worker:{worker_id}"


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode
    address: str  # gRPC host:port
    model: str
    namespace: str  # the engine's prefix-cache namespace: block hashes are only comparable within one
    block_size: int
    max_model_len: int
    metrics_address: str = ""  # host:port of /metrics
    ready: bool = False
    draining: bool = False
    # load, refreshed each heartbeat
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_spill_blocks_total: int = 0  # blocks its spill tier holds at most (0: no spill tier)
    loras: list[str] = field(default_factory=list)  # LoRA adapters it serves (services/lora_registry.py)
    loaded_loras: list[str] = field(default_factory=list)  # of those, held in its slots now (no load to wait for)
    kv_block_bytes: int = 0  # bytes of one KV block (the peer-fetch cost model's transfer size; 0: unknown)
    kv_fetch_bytes_per_s: float = 0.0  # its peer fetches' measured rate, bytes over seconds end to end (0: none yet)
    heartbeat_at: float = field(default_factory=time.time)

    @property
    def kv_cache_capacity(self) -> int:
        """Cached blocks it can hold across both tiers (pool and spill)."""
        return self.kv_blocks_total + self.kv_spill_blocks_total

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str | bytes) -> "WorkerInfo":
        fields = json.loads(data)
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in fields.items() if k in known})


class Registrar:
    """Keeps one worker's entry alive: ``start`` registers and heartbeats, ``stop`` deregisters.

    ``refresh`` is called before each heartbeat to update the load fields.
    """

    def __init__(self, redis, info: WorkerInfo, refresh: Callable[[WorkerInfo], None] | None = None,
                 interval_s: float = 1.0, ttl_s: float = 3.0):
        if ttl_s <= interval_s:
            raise ValueError("the registry TTL must exceed the heartbeat interval")
        self.redis = redis
        self.info = info
        self.refresh = refresh
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self._task: asyncio.Task | None = None
        self._beat: asyncio.Future | None = None  # the heartbeat in flight, if any

    async def beat(self) -> None:
        if self.refresh is not None:
            self.refresh(self.info)
        self.info.heartbeat_at = time.time()
        entry = self.info.to_json()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(worker_key(self.info.worker_id), entry, px=self.ttl_ms)
            pipe.sadd(WORKERS_KEY, self.info.worker_id)
            pipe.publish(CHANGES_CHANNEL, entry)
            await pipe.execute()

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.create_task(self._run(), name="registry-heartbeat")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            # shielded: a cancel landing inside redis-py's pipeline could leave stop() waiting forever (a
            # worker SIGTERMed as its first heartbeat ran never exited); stop() lets the beat finish instead
            self._beat = asyncio.ensure_future(self.beat())
            try:
                await asyncio.shield(self._beat)
            except Exception as exc:  # Redis away for a moment: the TTL decides, keep trying
                log.warning("heartbeat failed: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._beat is not None and not self._beat.done():  # finished first, so it cannot re-add the entry
            await asyncio.wait({self._beat}, timeout=self.ttl_ms / 1000)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(worker_key(self.info.worker_id))
                pipe.srem(WORKERS_KEY, self.info.worker_id)
                pipe.publish(CHANGES_CHANNEL, json.dumps({"worker_id": self.info.worker_id, "left": True}))
                await pipe.execute()
        except Exception as exc:
            log.warning("deregister failed (the entry expires by itself): %s", exc)


def parse_change(message: str | bytes) -> tuple[str, WorkerInfo | None]:
    """A CHANGES_CHANNEL message: (worker id, its entry), or (worker id, None) for a worker that left."""
    fields = json.loads(message)
    if fields.get("left"):
        return str(fields["worker_id"]), None
    info = WorkerInfo.from_json(message)
    return info.worker_id, info


async def read_workers(redis) -> list[WorkerInfo]:
    """Every live worker's entry; ids whose entry expired are dropped from the set."""
    ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await redis.smembers(WORKERS_KEY))
    if not ids:
        return []
    values = await redis.mget([worker_key(i) for i in ids])
    workers, gone = [], []
    for worker_id, value in zip(ids, values):
        if value is None:
            gone.append(worker_id)
        else:
            workers.append(WorkerInfo.from_json(value))
    if gone:
        await redis.srem(WORKERS_KEY, *gone)
    return workers
