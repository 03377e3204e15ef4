"""In-process transfer metrics: plain counters and fixed-bucket histograms.

One ``TransferStats`` per sender or receiver. The telemetry issue will export
``snapshot()`` as ``pdserve_kv_transfer_*`` Prometheus metrics; the bucket
bounds follow Prometheus conventions (cumulative ``le`` buckets plus +Inf) so
that export is a straight copy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# 1 ms .. 60 s: a transfer of one short prompt over shared memory takes about a
# millisecond; anything near a minute is a stuck peer.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# 64 KiB .. 4 GiB: one block of a small model up to the KV of a long prompt.
BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 33, 2))


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # non-cumulative, len(bounds) + 1
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError("histogram bounds must be increasing")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> dict:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return {
            "buckets": dict(zip([*map(str, self.bounds), "+Inf"], cumulative)),
            "sum": self.total,
            "count": self.count,
        }


@dataclass
class TransferStats:
    completed: int = 0
    failed: int = 0  # every failure, timeouts included
    timeouts: int = 0
    refused_peers: int = 0  # connections refused by the compatibility check
    bytes_total: int = 0
    seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    bytes: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))

    def record_success(self, nbytes: int, seconds: float) -> None:
        self.completed += 1
        self.bytes_total += nbytes
        self.bytes.observe(nbytes)
        self.seconds.observe(seconds)

    def record_failure(self, *, timeout: bool = False) -> None:
        self.failed += 1
        if timeout:
            self.timeouts += 1

    def snapshot(self) -> dict:
        return {
            "completed": self.completed,
            "failed": self.failed,
            "timeouts": self.timeouts,
            "refused_peers": self.refused_peers,
            "bytes_total": self.bytes_total,
            "seconds": self.seconds.snapshot(),
            "bytes": self.bytes.snapshot(),
        }
