"""The gateway's typed configuration, validated where it is built (server.py builds it from flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.queue import QueueConfig
from services.queue.config import DEFAULT_TIERS


@dataclass
class GatewayConfig:
    # request bodies larger than this are refused (413) before they are parsed
    max_body_bytes: int = 1 << 20
    # backpressure: refuse (429) while the queue holds this many unfinished requests / prompt tokens.
    # A waiting request costs the gateway memory, not a Redis connection (delivery.py), so the
    # queue takes a burst far larger than the workers run at once (the router's --max-inflight)
    max_queued_requests: int = 10_000
    max_queued_tokens: int = 4_000_000
    # Redis connections this process opens at most, whatever the number of open requests (one of
    # them reads every request's results); a command waits up to redis_pool_timeout_s for a free
    # one, then the request gets 503 + Retry-After
    redis_max_connections: int = 32
    redis_pool_timeout_s: float = 10.0
    # what a 429 or 503 for overload tells the client to wait
    retry_after_s: float = 1.0
    # x-pdserve-timeout when the client sends none, and the most it may ask for
    default_timeout_s: float = 600.0
    max_timeout_s: float = 3600.0
    # a client that disconnects is given this long to resume before its request is cancelled
    disconnect_grace_s: float = 5.0
    # an SSE comment is sent after this long without an event (keeps proxies from timing out)
    sse_heartbeat_s: float = 15.0
    # past a request's deadline the router writes a deadline error itself; wait this long for it
    deadline_grace_s: float = 30.0
    # how stale the queue depth and the worker list may be when admitting
    depth_cache_s: float = 0.1
    workers_cache_s: float = 0.25
    # how long an Idempotency-Key and a request's record (what a resume needs) are kept
    idempotency_ttl_s: int = 3600
    record_ttl_s: int = 3600
    # how long a Responses API response (store: true) is kept for GET and previous_response_id
    response_ttl_s: int = 7 * 24 * 3600
    # choices per request (n, best_of): each is a child request (choices.py), so this bounds one request's fan-out
    max_n: int = 8
    # the context length when no decode worker says (None: the model's own config)
    max_model_len: int | None = None
    # priority tiers, highest first (the queue's); tenant of an unauthenticated gateway gets default_tier
    tiers: tuple[str, ...] = DEFAULT_TIERS
    default_tier: str = "standard"
    # identical greedy or seeded requests in flight are computed once (coalescing.py); False: each on its own
    coalesce: bool = True
    # answer 503 while no decode worker is ready (False: queue anyway, e.g. workers start later)
    require_ready_worker: bool = True
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes.py); off: 404
    lora_admin: bool = False

    def __post_init__(self) -> None:
        self.tiers = tuple(self.tiers)
        for name in ("max_body_bytes", "max_queued_requests", "max_queued_tokens", "idempotency_ttl_s",
                     "record_ttl_s", "response_ttl_s", "redis_max_connections", "max_n"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if self.redis_max_connections < 4:  # the result reader holds one; admission needs a few more
            raise ValueError(f"redis_max_connections must be >= 4; got {self.redis_max_connections}")
        for name in ("retry_after_s", "default_timeout_s", "max_timeout_s", "sse_heartbeat_s", "redis_pool_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a number > 0; got {value!r}")
        for name in ("disconnect_grace_s", "deadline_grace_s", "depth_cache_s", "workers_cache_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0; got {value!r}")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s must not exceed max_timeout_s")
        if self.max_model_len is not None and (type(self.max_model_len) is not int or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2; got {self.max_model_len!r}")
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the tiers {list(self.tiers)}")

    def queue_config(self) -> QueueConfig:
        """The admission queue's config: its atomic bounds are the gateway's backpressure limits."""
        return QueueConfig(tiers=self.tiers, max_queued_requests=self.max_queued_requests,
                           max_queued_prompt_tokens=self.max_queued_tokens, retry_after_s=self.retry_after_s)
