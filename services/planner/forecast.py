"""The demand by time of day, learned from earlier days: what ``Planner`` reads ahead instead of a trend.

A day's traffic repeats with the time of day (the diurnal swing) and differs by day in its noise and its
bursts. ``DemandForecast`` keeps, per bin of the period, each recorded day's mean demand (prefill tokens/s
computed, KV blocks in use, running sequences) and forecasts the median of the days, bin by bin: a burst on
one day of three drops out. The planner scales the forecast to the day it sees (the demand over the trend
window against the forecast's over the same window), so a heavier day, or the sessions a burst started, raise
it; the forecast's shape then says what the next cold start brings.

The live service (``pdserve planner --forecast-file``) records its own signals here as it runs and keeps the
file across restarts; the simulator builds one from other days' demand curves
(``benchmarks/probes/autoscale_demand_curve.py``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field

Demand = tuple[float, float, float]  # prefill tokens/s computed, KV blocks in use, running sequences


@dataclass
class DemandForecast:
    period_s: float = 86_400.0
    bin_s: float = 300.0
    keep_days: int = 7
    # each recorded day: per bin, its mean demand, or None where nothing was recorded
    days: list[list[Demand | None]] = field(default_factory=list)
    _day: int | None = None  # the day being recorded (now // period_s)
    _sums: dict = field(default_factory=dict)  # bin -> [n, tokens/s, KV, sequences] of the day being recorded
    _median: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.period_s > 0 and 0 < self.bin_s <= self.period_s) or self.keep_days < 1:
            raise ValueError("the forecast needs period_s > 0, 0 < bin_s <= period_s and keep_days >= 1")
        for day in self.days:
            if len(day) != self.bins:
                raise ValueError(f"a recorded day has {len(day)} bins, the forecast {self.bins}")
        self._update()

    @property
    def bins(self) -> int:
        return math.ceil(self.period_s / self.bin_s)

    def _update(self) -> None:
        self.days = self.days[-self.keep_days:]
        self._median = []
        for b in range(self.bins):
            seen = [day[b] for day in self.days if day[b] is not None]
            self._median.append(tuple(statistics.median(d[i] for d in seen) for i in range(3)) if seen else None)

    def _bin(self, t: float) -> int:
        return int((t % self.period_s) // self.bin_s) % self.bins

    def _over(self, start: float, end: float) -> list[Demand] | None:
        """The forecast's bins that [start, end] overlaps (one at least), or None if any has no day recorded."""
        first, last = math.floor(start / self.bin_s), math.floor(end / self.bin_s)
        out = [self._median[self._bin(b * self.bin_s)] for b in range(first, max(first, last) + 1)]
        return None if any(d is None for d in out) else out

    def expected(self, start: float, end: float) -> Demand | None:
        """The forecast's mean demand over [start, end] (None: no day recorded for part of it)."""
        over = self._over(start, end)
        return None if over is None else tuple(sum(d[i] for d in over) / len(over) for i in range(3))

    def peak(self, start: float, end: float) -> Demand | None:
        """The forecast's highest demand over [start, end], per signal."""
        over = self._over(start, end)
        return None if over is None else tuple(max(d[i] for d in over) for i in range(3))

    def record(self, now: float, demand: Demand) -> None:
        """One reading of the live signals; a day is added to the forecast once the next one starts."""
        day = int(now // self.period_s)
        if self._day is not None and day != self._day:
            self._close()
        self._day = day
        acc = self._sums.setdefault(self._bin(now), [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        for i in range(3):
            acc[i + 1] += demand[i]

    def _close(self) -> None:
        if self._sums:
            self.days.append([tuple(a / s[0] for a in s[1:]) if (s := self._sums.get(b)) else None
                              for b in range(self.bins)])
            self._update()
        self._sums = {}

    def to_json(self) -> dict:
        return {"period_s": self.period_s, "bin_s": self.bin_s, "days": self.days,
                "recording": {"day": self._day, "bins": {str(b): s for b, s in self._sums.items()}}}

    @classmethod
    def from_json(cls, data: dict, keep_days: int = 7) -> DemandForecast:
        days = [[None if d is None else tuple(d) for d in day] for day in data.get("days", [])]
        f = cls(float(data["period_s"]), float(data["bin_s"]), keep_days, days)
        recording = data.get("recording") or {}
        f._day = recording.get("day")
        f._sums = {int(b): list(s) for b, s in (recording.get("bins") or {}).items()}
        return f

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as out:
            json.dump(self.to_json(), out)
        os.replace(tmp, path)  # a crash mid-write leaves the last whole file

    @classmethod
    def load(cls, path: str, period_s: float, bin_s: float, keep_days: int = 7) -> DemandForecast:
        """The file's forecast, or an empty one if it does not exist yet; its bins must match."""
        if not os.path.exists(path):
            return cls(period_s, bin_s, keep_days)
        with open(path) as f:
            data = json.load(f)
        if (float(data["period_s"]), float(data["bin_s"])) != (period_s, bin_s):
            raise ValueError(f"{path} was recorded with period {data['period_s']} s and bins of {data['bin_s']} s, "
                             f"not {period_s:g} and {bin_s:g}")
        return cls.from_json(data, keep_days)

    @classmethod
    def from_curves(cls, curves: list[dict], tok_factor: float = 1.0, kv_factor: float = 1.0,
                    period_s: float | None = None) -> DemandForecast:
        """From demand curves (``autoscale_demand_curve.py``: ``bin_s``, ``tok_s``, ``kv`` per bin), one day
        each, scaled by the factors that turn a curve into the planner's signals; no sequences."""
        if not curves:
            raise ValueError("no demand curve given")
        bin_s = float(curves[0]["bin_s"])
        if any(float(c["bin_s"]) != bin_s for c in curves):
            raise ValueError("the curves' bins differ")
        n = len(curves[0]["tok_s"])
        period = period_s or n * bin_s
        bins = math.ceil(period / bin_s)
        days = [[(c["tok_s"][b] * tok_factor, c["kv"][b] * kv_factor, 0.0) if b < len(c["tok_s"]) else None
                 for b in range(bins)] for c in curves]
        return cls(period, bin_s, len(days), days)
