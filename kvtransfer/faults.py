"""Fault injection for tests and ``pdserve bench chaos``: KV transfers that time out, on purpose.

Off unless ``PDSERVE_KV_FAULTS`` is set in the sending (prefill) process's
environment when its ``Sender`` is created; nothing is changed at run time::

    PDSERVE_KV_FAULTS="timeout:2,timeout:5"   this process's 2nd and 5th transfers time out
    PDSERVE_KV_FAULT_STALL_S=30               how long such a transfer's finish is held back (default 30)

A transfer chosen to time out sends its blocks as usual, then holds its finish
back for the stall: the receiver's reservation (the router's ``--transfer-timeout``)
runs out first, the decode worker frees the blocks and says so, and the request
must be retried or fail with a clear error, as for a real stalled link.
"""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)

ENV, STALL_ENV = "PDSERVE_KV_FAULTS", "PDSERVE_KV_FAULT_STALL_S"
KINDS = ("timeout",)


class TransferFaults:
    def __init__(self, timeouts: set[int] = frozenset(), stall_s: float = 30.0):
        self.timeouts, self.stall_s = set(timeouts), stall_s
        self.finished = 0  # transfers this sender has finished (or tried to)
        self.injected = 0

    @classmethod
    def from_env(cls, environ=os.environ) -> TransferFaults:
        spec = environ.get(ENV, "").strip()
        timeouts = set()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, n = part.partition(":")
            if kind not in KINDS or not n.isdigit() or int(n) < 1:
                raise ValueError(f"{ENV}: expected entries like 'timeout:3' (kinds: {', '.join(KINDS)}); "
                                 f"got {part!r}")
            timeouts.add(int(n))
        stall = float(environ.get(STALL_ENV, "30"))
        if stall <= 0:
            raise ValueError(f"{STALL_ENV} must be > 0; got {stall}")
        if timeouts:
            log.warning("fault injection on (%s=%s): transfers %s will time out", ENV, spec, sorted(timeouts))
        return cls(timeouts, stall)

    async def before_finish(self, transfer_id: str) -> None:
        self.finished += 1
        if self.finished in self.timeouts:
            self.injected += 1
            log.warning("fault injection: holding back the finish of %s for %g s", transfer_id, self.stall_s)
            await asyncio.sleep(self.stall_s)
