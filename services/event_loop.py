"""How the gateway and the workers run their event loops: uvloop when installed, and a garbage collector that
skips startup's objects.

The gateway is one event loop holding every open stream: whatever stops the
loop delays every chunk due meanwhile. A worker's loop runs beside its engine
thread and writes each engine step's tokens to Redis: on a small machine the
CPU it spends per step is taken from the cores the engine's threads compute on
(issue 27's batch-1 gap; BENCHMARKS.md, bench hops). ``pdserve bench frontdoor``'s probe
(fanout_probe.py) measured two such stops at 1,000 open streams:

- the stdlib loop's own cost per callback and per socket write, which uvloop
  (libuv, in C) cuts; ``--loop asyncio`` keeps the stdlib loop;
- full garbage collections that each walked every object made at startup (the
  web framework, the tokenizer, the served model's tables: some 75,000 objects,
  0.1-1 s per collection on a busy CPU). ``settle_gc`` collects once after
  startup and moves what survived to the permanent generation (``gc.freeze``),
  so later collections walk only the objects of the requests in flight.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Coroutine

log = logging.getLogger(__name__)
LOOPS = ("auto", "uvloop", "asyncio")
# The gateway's: a full (generation-2) collection walks every object of every open stream (80-106 ms at 1,000
# streams on this project's 2-core Xeon, the longest stop of its loop); after ten times as many younger
# collections as Python's default, it comes once in minutes of serving instead of once or twice a minute.
# Cyclic garbage waits longer for it: BENCHMARKS.md (bench frontdoor) has the memory at 10,000 clients.
GATEWAY_GC_THRESHOLDS = (700, 10, 100)


def run(main: Coroutine, loop: str = "auto"):
    """``asyncio.run(main)`` on uvloop (``auto``: when it is installed) or on the stdlib loop."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}; got {loop!r}")
    factory = None
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                main.close()
                raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def settle_gc(thresholds: tuple[int, int, int] | None = None) -> None:
    """After startup: collect, then exempt the survivors from every later collection; ``thresholds``, when
    given, replace the collector's (gc.set_threshold)."""
    gc.collect()
    gc.freeze()
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    log.info("gc: %d startup objects frozen, thresholds %s", gc.get_freeze_count(), gc.get_threshold())


def parse_gc_thresholds(text: str) -> tuple[int, int, int]:
    """``"700,10,10"`` -> (700, 10, 10): gc.set_threshold's three numbers, each >= 1."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"gc thresholds are three whole numbers >= 1, e.g. 700,10,10; got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]
