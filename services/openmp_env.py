"""How idle OpenMP threads wait in pdserve's processes: asleep, unless the user says otherwise.

The CPU kernels (kernels/*.c) and torch share one libgomp thread pool. libgomp's default
makes an idle pool thread spin for up to ``GOMP_SPINCOUNT`` (300,000) iterations after
each parallel region before it sleeps. An engine step is many short parallel regions with
Python between them, and a served token also needs the gateway, the router, Redis and the
worker's own event loop: with as many pool threads as cores, the spinning thread holds a
core those processes need, and when one of them holds it instead, the pool's next barrier
waits for a thread that is not running. On the 2-core machine a 2-thread engine at batch 1
ran 3-10x faster with passive waiting once other processes shared the cores
(benchmarks/probes/omp_wait_policy.py; BENCHMARKS.md, "bench peer").

libgomp reads the policy when it loads (with torch), so ``apply`` runs first thing in
``pdserve``'s main, and every process ``pdserve up`` starts inherits it. A user's own
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left as it is (``GOMP_SPINCOUNT=300000``
restores libgomp's default).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULT = "PASSIVE"
chosen_here = False  # apply() set the policy in this process (``pdserve up`` says so)


def apply(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a wait policy; True if it was set here."""
    global chosen_here
    if any(environ.get(name) for name in USER_SETTINGS):
        return False
    environ["OMP_WAIT_POLICY"] = DEFAULT
    chosen_here = environ is os.environ
    return True
