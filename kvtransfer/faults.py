"""Fault injection for tests and ``pdserve bench chaos``: KV transfers that time out or arrive
corrupted, on purpose.

Off unless ``PDSERVE_KV_FAULTS`` is set in the process's environment when its
``Sender`` (timeouts: the prefill side) or ``Receiver`` (corruption: the decode
side) is created; nothing is changed at run time::

    PDSERVE_KV_FAULTS="timeout:2,timeout:5"   this sender's 2nd and 5th transfers time out
    PDSERVE_KV_FAULTS="corrupt:3"             the 3rd chunk this receiver takes in lands with garbage
    PDSERVE_KV_FAULT_STALL_S=30               how long such a transfer's finish is held back (default 30)

A transfer chosen to time out sends its blocks as usual, then holds its finish
back for the stall: the receiver's reservation (the router's ``--transfer-timeout``)
runs out first, the decode worker frees the blocks and says so, and the request
must be retried or fail with a clear error, as for a real stalled link.

A chunk chosen to be corrupted has bytes of its first run inverted after they
land and before the receiver checks the run's checksum (kvtransfer/checksum.py),
as a bad link or a wrong offset would leave them: the check must catch it, fail
the transfer and free its blocks, and the request be retried or fail clearly.
"""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)

ENV, STALL_ENV = "PDSERVE_KV_FAULTS", "PDSERVE_KV_FAULT_STALL_S"
KINDS = ("timeout", "corrupt")


class TransferFaults:
    def __init__(self, timeouts: set[int] = frozenset(), stall_s: float = 30.0, corrupts: set[int] = frozenset()):
        self.timeouts, self.stall_s, self.corrupts = set(timeouts), stall_s, set(corrupts)
        self.finished = 0  # transfers this sender has finished (or tried to)
        self.landed = 0  # chunks this receiver has taken in
        self.injected = 0

    @classmethod
    def from_env(cls, environ=os.environ) -> TransferFaults:
        spec = environ.get(ENV, "").strip()
        chosen: dict[str, set[int]] = {kind: set() for kind in KINDS}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, n = part.partition(":")
            if kind not in KINDS or not n.isdigit() or int(n) < 1:
                raise ValueError(f"{ENV}: expected entries like 'timeout:3' (kinds: {', '.join(KINDS)}); "
                                 f"got {part!r}")
            chosen[kind].add(int(n))
        stall = float(environ.get(STALL_ENV, "30"))
        if stall <= 0:
            raise ValueError(f"{STALL_ENV} must be > 0; got {stall}")
        if spec:
            log.warning("fault injection on (%s=%s)", ENV, spec)
        return cls(chosen["timeout"], stall, chosen["corrupt"])

    async def before_finish(self, transfer_id: str) -> None:
        self.finished += 1
        if self.finished in self.timeouts:
            self.injected += 1
            log.warning("fault injection: holding back the finish of %s for %g s", transfer_id, self.stall_s)
            await asyncio.sleep(self.stall_s)

    def after_landing(self, transfer_id: str, runs: list) -> None:
        """Called by the receiver once a chunk's bytes are in place, before it checks them."""
        self.landed += 1
        if self.landed in self.corrupts and runs:
            self.injected += 1
            log.warning("fault injection: corrupting a chunk of %s", transfer_id)
            head = runs[0][:64]
            head.bitwise_not_()
