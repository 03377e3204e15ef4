"""``phase(name)``: a named range around one phase of a worker's engine step.

Minimal version written by the profiling work (issue 26); the per-phase breakdown
work owns this module and adds its Prometheus histograms behind the same signature.

The range is a ``torch.profiler.record_function`` (it shows in a torch profiler
trace, see ``pdserve profile``; costs about a microsecond when no profiler runs)
and, on CUDA, an NVTX range, so Nsight Systems shows the phases without code changes.
Imported by workers only (it loads torch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_NVTX = torch.cuda.is_available()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    with torch.profiler.record_function(name):
        if _NVTX:
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield
