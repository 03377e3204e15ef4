"""Backpressure: refuse (429 + Retry-After) while the queue is over the gateway's limits, before queueing.

The queue depth (``AdmissionQueue.depth``: unfinished requests and their prompt
tokens per tier) is read at most once per ``depth_cache_s`` however many
requests arrive, so a burst costs Redis one pipeline per interval, and only
when a request finds it older than that: that request is checked against the
value it finds and the read goes on in the background (cached_read.py,
``serve_stale``), so no request waits for it and an idle gateway reads nothing
(it read every 80 ms). A request the value would refuse is checked again on a
current one (the queue may have drained since). The cached check is the cheap early refusal; the enqueue
script checks the same limits atomically (``GatewayConfig.queue_config``), so a
stale cache never overfills the queue.
"""

from __future__ import annotations

from services import telemetry
from services.gateway.cached_read import CachedRead
from services.queue import AdmissionQueue, QueueDepth
from services.queue.admission import capacity_error


class QueueLoad:
    def __init__(self, queue: AdmissionQueue, max_requests: int, max_tokens: int, retry_after_s: float,
                 cache_s: float = 0.1):
        self.queue = queue
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.retry_after_s = retry_after_s
        self._cache = CachedRead(self._read, cache_s, serve_stale=True)

    async def _read(self) -> QueueDepth:
        depth = await self.queue.depth()
        for tier, d in depth.tiers.items():
            telemetry.QUEUE_DEPTH.labels(tier).set(d.requests)
        return depth

    async def depth(self) -> QueueDepth:
        return await self._cache.get()

    async def read_now(self) -> QueueDepth:
        """The depth read now (``/metrics``: the gauge as it is, not as the last request left it)."""
        return await self._read()

    def _over(self, depth: QueueDepth, prompt_tokens: int) -> bool:
        return depth.requests >= self.max_requests or depth.prompt_tokens + prompt_tokens > self.max_tokens

    async def check(self, prompt_tokens: int) -> None:
        """Raise ``CapacityError`` (429, ``retry_after_s``) when one more request would exceed a limit."""
        depth = await self.depth()
        if self._over(depth, prompt_tokens):  # a refusal is made on a value no older than depth_cache_s
            depth = await self._cache.current()
        if depth.requests >= self.max_requests:
            raise capacity_error(f"the server is overloaded: {depth.requests} requests queued (limit "
                                 f"{self.max_requests}); retry after {self.retry_after_s:g} s", self.retry_after_s)
        if depth.prompt_tokens + prompt_tokens > self.max_tokens:
            raise capacity_error(f"the server is overloaded: {depth.prompt_tokens} prompt tokens queued (limit "
                                 f"{self.max_tokens}); retry after {self.retry_after_s:g} s", self.retry_after_s)
