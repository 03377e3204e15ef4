"""Where the time goes, always on: ``phase(name)`` times a block into ``pdserve_phase_seconds``.

One histogram, labelled by ``role`` (prefill, decode, gateway; ``engine`` for an engine
run in-process) and ``phase``::

    prefill / decode engine loop, one observation per phase per iteration
        schedule  forward_prefill | forward_decode | forward_mixed  sample
        postprocess (token bookkeeping, detokenize)  publish (results out)
        commands (adds/aborts between steps)  idle (nothing to run)
    decode, per request        kv_transfer_wait (reservation to the last KV byte)
    prefill, per request       kv_transfer_wait (prefill done to the last KV byte sent)
    gateway, per request       admission  queue_wait  first_chunk  streaming (they tile its time
                               there: services/gateway/metrics.py observe_phases)

``pdserve_engine_loop_seconds`` is the whole engine-loop iteration those step phases
tile, so ``sum(phase sums) / loop sum`` says what share of the engine thread's wall time
the phases account for (``pdserve bench breakdown`` prints the rest as "unaccounted").

On CUDA the forward phase is the time to launch its kernels (or replay its graph): the
host waits for the GPU where it first reads a result, in ``sample``; put the two together
there, or read the NVTX ranges in Nsight Systems for the device-side split.

Cost: one ``time.perf_counter()`` pair and one histogram observe per phase; no objects
per token. The same ranges show in profilers without code changes: a
``torch.profiler.record_function`` range named after the phase while the torch profiler
records (``pdserve profile``), and an NVTX range when CUDA is initialised (so ``nsys
profile`` shows them); ``profiler_range`` is the range alone (``engine.step``). Torch is only looked up
in ``sys.modules``, never imported here: the gateway and router stay torch-free.
"""

from __future__ import annotations

import sys
import threading
import time

from prometheus_client import Histogram

# 50 us .. 60 s: a schedule or sample phase is tens of microseconds, an idle wait up to 50 ms,
# a long prefill or a queued request seconds.
PHASE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

PHASE_SECONDS = Histogram("pdserve_phase_seconds",
                          "Wall time by phase: per engine-loop iteration in workers, per request in the gateway "
                          "(and for KV transfer waits).", ["role", "phase"], buckets=PHASE_BUCKETS)
ENGINE_LOOP_SECONDS = Histogram("pdserve_engine_loop_seconds",
                                "Wall time of one engine-loop iteration (the step phases tile it).", ["role"],
                                buckets=PHASE_BUCKETS)

STEP_PHASES = ("schedule", "forward_prefill", "forward_decode", "forward_mixed", "sample", "postprocess",
               "publish", "commands", "idle")
REQUEST_PHASES = {"gateway": ("admission", "queue_wait", "first_chunk", "streaming"), "decode": ("kv_transfer_wait",),
                  "prefill": ("kv_transfer_wait",)}

# The role label is per thread: a worker's engine thread says prefill or decode (AsyncEngine
# sets it), so two engines in one process (tests, in-process benches) keep their own series.
_local = threading.local()
_children: dict[tuple[str, str], object] = {}


def set_role(role: str) -> None:
    """The ``role`` label of the phases this thread records (``engine`` until set)."""
    _local.role = role


def role() -> str:
    return getattr(_local, "role", "engine")


def _child(name: str, role_: str | None):
    key = (role_ or role(), name)
    child = _children.get(key)
    if child is None:  # labels() costs a lock and a dict lookup: once per (role, phase)
        child = _children[key] = PHASE_SECONDS.labels(*key)
    return child


def observe(name: str, seconds: float, role: str | None = None) -> None:
    """Record a phase measured elsewhere (e.g. a transfer's own clock)."""
    _child(name, role).observe(seconds)


def _profiler_range(name: str):
    """A torch profiler range for ``name``, or None when no profiler records (the usual case)."""
    torch = sys.modules.get("torch")  # inline, not profiler_recording(): this runs for every phase
    if torch is None or not torch.autograd.profiler._is_profiler_enabled:
        return None
    return torch.profiler.record_function(name)


def profiler_recording() -> bool:
    """Whether the torch profiler records now (``pdserve profile``): what a range costs nothing to skip."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.autograd.profiler._is_profiler_enabled


class profiler_range:
    """``with profiler_range("engine.step"): ...``: a torch-profiler / NVTX range only, no histogram
    (``pdserve profile`` counts a worker's ``engine.step`` ranges; the step's phases tile it)."""

    __slots__ = ("name", "_range", "_nvtx")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> "profiler_range":
        self._range = _profiler_range(self.name)
        if self._range is not None:
            self._range.__enter__()
        self._nvtx = _nvtx_push(self.name)
        return self

    def __exit__(self, *exc) -> None:
        if self._nvtx:
            sys.modules["torch"].cuda.nvtx.range_pop()
        if self._range is not None:
            self._range.__exit__(*exc)


class phase:
    """``with phase("sample"): ...``: times the block into ``pdserve_phase_seconds{role, phase}``.

    A fresh object per use (cheap: slots, no generator), so concurrent asyncio tasks can
    each hold one. The time is recorded even if the block raises.
    """

    __slots__ = ("name", "role", "started", "_range", "_nvtx")

    def __init__(self, name: str, role: str | None = None) -> None:
        self.name, self.role = name, role

    def __enter__(self) -> "phase":
        self._range = _profiler_range(self.name)
        if self._range is not None:
            self._range.__enter__()
        self._nvtx = _nvtx_push(self.name)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.started
        _child(self.name, self.role).observe(elapsed)
        if self._nvtx:
            sys.modules["torch"].cuda.nvtx.range_pop()
        if self._range is not None:
            self._range.__exit__(*exc)


def _nvtx_push(name: str) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    torch.cuda.nvtx.range_push(name)
    return True
