"""Percentiles and ratios, one definition for every benchmark."""

from __future__ import annotations

import math


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks; NaN when empty."""
    values = sorted(values)
    if not values:
        return float("nan")
    pos = (len(values) - 1) * min(100.0, max(0.0, q)) / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """``a / b`` rounded, or None when either is missing, NaN or ``b`` is 0."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, digits)
