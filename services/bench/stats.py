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


def time_per_output_token(sample) -> float | None:
    """One request's inter-token latency as guidellm, aiperf and vLLM's TPOT define it: its decode window
    over the tokens after the first, ``(last content chunk - first content chunk) / (tokens - 1)``.
    Unlike the gaps between chunks, a server that delivers tokens in bursts does not lower it."""
    if sample.tokens < 2:
        return None
    return sum(sample.gaps) / (sample.tokens - 1)


def summarize(samples, wall_s: float, slo_ttft_s: float, slo_itl_s: float) -> dict:
    """Latency percentiles (ms), output throughput and goodput of load-generator samples (load.Sample).

    Goodput counts the requests per second that completed with TTFT within ``slo_ttft_s``
    and a median gap between chunks within ``slo_itl_s``. ``itl_ms_*``: percentiles of every gap
    between content chunks; ``tpot_ms_*``: percentiles over requests of ``time_per_output_token``.
    """
    ok = [s for s in samples if s.ok]
    tpot = [t for t in map(time_per_output_token, ok) if t is not None]
    gaps = [g for s in ok for g in s.gaps]
    good = [s for s in ok if s.ttft <= slo_ttft_s and (not s.gaps or percentile(s.gaps, 50) <= slo_itl_s)]
    return {
        "requests": len(samples), "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if not s.ok})[:3],
        "ttft_ms_p50": percentile([s.ttft for s in ok], 50) * 1e3,
        "ttft_ms_p90": percentile([s.ttft for s in ok], 90) * 1e3,
        "ttft_ms_p99": percentile([s.ttft for s in ok], 99) * 1e3,
        "itl_ms_p50": percentile(gaps, 50) * 1e3, "itl_ms_p90": percentile(gaps, 90) * 1e3,
        "itl_ms_p99": percentile(gaps, 99) * 1e3,
        "tpot_ms_p50": percentile(tpot, 50) * 1e3, "tpot_ms_p90": percentile(tpot, 90) * 1e3,
        "tpot_ms_p99": percentile(tpot, 99) * 1e3,
        "e2e_ms_p50": percentile([s.e2e for s in ok], 50) * 1e3,
        "e2e_ms_p99": percentile([s.e2e for s in ok], 99) * 1e3,
        "output_tok_s": sum(s.tokens for s in ok) / wall_s if wall_s > 0 else 0.0,
        "requests_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "goodput_req_s": len(good) / wall_s if wall_s > 0 else 0.0, "wall_s": wall_s,
    }


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def bootstrap_interval(values, statistic=mean, level: float = 0.9, resamples: int = 4000,
                       seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of ``statistic`` over ``values`` (resampled with replacement,
    seeded so a report is reproducible); (nan, nan) for fewer than two values, where there is no spread."""
    import random

    values = list(values)
    if len(values) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    draws = [statistic(rng.choices(values, k=len(values))) for _ in range(resamples)]
    tail = (1 - level) / 2 * 100
    return percentile(draws, tail), percentile(draws, 100 - tail)
