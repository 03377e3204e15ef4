"""The autoscale probes' shared day: their command-line arguments and the trace they build from them.

The bench's autoscale part (``pdserve bench sim --parts autoscale``) runs the h100 profile on a diurnal
day compressed to ``--period-s`` (k = 12 at 7,200 s). Each probe names the same day by trace shape, seed and
session starts per second; this builds it once, the way the bench does (``experiments.diurnal_day``).
"""

from __future__ import annotations

import argparse

from services.sim import experiments
from services.sim.day_scale import DayScale
from services.sim.profiles import WorkerProfile, load_profile


def add_day_arguments(ap: argparse.ArgumentParser, rate: float = 8.0, config_help: str | None = None) -> None:
    """``shape`` and ``seed`` (positional), ``--rate``; with ``config_help``, a PlannerConfig JSON after them."""
    ap.add_argument("shape", choices=list(experiments.TRACE_SHAPES))
    ap.add_argument("seed", type=int)
    if config_help is not None:
        ap.add_argument("config", nargs="?", default="{}", help=config_help)
    ap.add_argument("--rate", type=float, default=rate, help="session starts per second")
    ap.add_argument("--profile", default="h100", help="the calibration profile (default h100, the bench's)")
    ap.add_argument("--cold-start-s", type=float, default=None,
                    help="a worker's cold start in real seconds over the profile's (gpu_cold_start.py measures one)")


def load_day(args: argparse.Namespace, period_s: float = 7200.0) -> tuple[WorkerProfile, DayScale, list]:
    """The profile (``--profile``, h100 by default; uncompressed), the day's scale and its requests."""
    profile, scale, trace, _ = load_day_and_arrivals(args, period_s)
    return profile, scale, trace


def load_day_and_arrivals(args: argparse.Namespace, period_s: float = 7200.0):
    """``load_day``'s three and the day's arrival shape (its ``bursts``: the (start, end) of each)."""
    profile = load_profile(getattr(args, "profile", "h100"), cold_start_s=getattr(args, "cold_start_s", None))
    scale = DayScale(period_s)
    trace, arrivals = experiments.diurnal_day(args.seed, profile, args.rate, scale, args.shape)
    return profile, scale, trace, arrivals
