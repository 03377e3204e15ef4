"""The queue's typed configuration, validated where it is built."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_TIERS = ("interactive", "standard", "batch")
DEFAULT_WEIGHTS = {"interactive": 8, "standard": 3, "batch": 1}
_TIER_NAME = re.compile(r"[a-z0-9_-]{1,32}")


@dataclass
class QueueConfig:
    # priority tiers, highest first; each has its own stream
    tiers: tuple[str, ...] = DEFAULT_TIERS
    # share of dequeues each tier gets while it has work (smooth weighted round-robin);
    # empty: DEFAULT_WEIGHTS, which covers the default tier names only
    weights: dict[str, int] = field(default_factory=dict)
    # deliveries after which a failing request is dead-lettered instead of retried
    max_deliveries: int = 3
    # how long a consumer may hold an entry without acking before others reclaim it
    claim_idle_ms: int = 30_000
    # admission bounds: requests not yet at a final state, and their prompt tokens
    max_queued_requests: int = 10_000
    max_queued_prompt_tokens: int = 4_000_000
    # per-request result streams expire this long after their last write
    result_ttl_s: int = 600
    # a finished request's state key (idempotency on request id) lives this long
    state_ttl_s: int = 3600
    # what a CapacityError tells the client to wait
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        self.tiers = tuple(self.tiers)
        if not self.tiers:
            raise ValueError("tiers must name at least one priority tier")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers must be distinct; got {list(self.tiers)}")
        bad = [t for t in self.tiers if not isinstance(t, str) or not _TIER_NAME.fullmatch(t)]
        if bad:
            raise ValueError(f"tier names must be 1-32 characters of [a-z0-9_-]; got {bad}")
        if not self.weights:
            unknown = [t for t in self.tiers if t not in DEFAULT_WEIGHTS]
            if unknown:
                raise ValueError(f"weights must be given for tiers without a default weight: {unknown}")
            self.weights = {t: DEFAULT_WEIGHTS[t] for t in self.tiers}
        self.weights = dict(self.weights)
        if set(self.weights) != set(self.tiers):
            raise ValueError(f"weights must name exactly the tiers {list(self.tiers)}; got {sorted(self.weights)}")
        for tier, weight in self.weights.items():
            if type(weight) is not int or weight < 1:
                raise ValueError(f"weight of tier {tier!r} must be an int >= 1; got {weight!r}")
        for name in ("max_deliveries", "claim_idle_ms", "max_queued_requests", "max_queued_prompt_tokens",
                     "result_ttl_s", "state_ttl_s"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if not self.retry_after_s > 0:
            raise ValueError(f"retry_after_s must be > 0; got {self.retry_after_s!r}")
