"""Where a chunk waits inside the gateway: per chunk, when the delivery reader read it and when it went out.

Off unless ``PDSERVE_FANOUT_PROBE_DIR`` names a directory (``pdserve bench
frontdoor --probe`` sets it for the stack it starts); off, each hook is one
global lookup. On, the gateway notes, in memory:

- ``read``: per chunk entry of the delivery stream, the wall time the XREAD that
  carried it returned, how many entries that XREAD carried and the entry's
  place among them (0: the oldest);
- ``written``: per chunk, the wall time its SSE event had been handed to the
  HTTP server, so the bytes are in the socket's transport (by the delivery
  reader itself, direct_write.py, or by the stream's task after Starlette's
  ``send``);
- the event loop's lag and the garbage collector's pauses (loop_lag.py).

and appends what is new to ``<dir>/gateway-<pid>.json`` lines every second.
The bench joins these with the times each chunk reached its client's socket and
a direct reader's (result_tap.py), by (request id, entry id): direct -> read is
the delivery stream's path through Redis and the gateway's loop, read -> written
the gateway's own queueing and work, written -> client the socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from services.loop_lag import LoopLag

ENV = "PDSERVE_FANOUT_PROBE_DIR"
_dir = os.environ.get(ENV) or None
_probe: _Probe | None = None


class _Probe:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, f"gateway-{os.getpid()}.json")
        self.reads: list[tuple[str, str, float, int, int]] = []
        self.writes: list[tuple[str, str, float]] = []
        self.lag = LoopLag()
        self._sent = {"reads": 0, "writes": 0, "lag": 0, "gc": 0}

    async def run(self) -> None:
        self.lag.start()
        try:
            while True:
                await asyncio.sleep(1.0)
                self.flush()
        finally:
            self.lag.stop()
            self.flush()

    def flush(self) -> None:
        parts = {"reads": self.reads, "writes": self.writes, "lag": self.lag.samples, "gc": self.lag.gc_pauses}
        new = {name: rows[self._sent[name]:] for name, rows in parts.items()}
        if not any(new.values()):
            return
        for name, rows in parts.items():
            self._sent[name] = len(rows)
        with open(self.path, "a") as f:
            f.write(json.dumps(new, separators=(",", ":")) + "\n")


def enabled() -> bool:
    return _dir is not None


def start() -> asyncio.Task | None:
    """Start probing in the running loop (once per process; None when off)."""
    global _probe
    if _dir is None or _probe is not None:
        return None
    _probe = _Probe(_dir)
    return asyncio.get_running_loop().create_task(_probe.run(), name="fanout-probe")


def read(request_id: str, entry_id: str, at: float, batch: int, position: int = 0) -> None:
    if _probe is not None:
        _probe.reads.append((request_id, entry_id, at, batch, position))


def written(request_id: str, entry_id: str) -> None:
    if _probe is not None:
        _probe.writes.append((request_id, entry_id, time.time()))


def load(directory: str) -> dict[str, list]:
    """Every gateway's records in ``directory``, merged: {"reads", "writes", "lag", "gc"}."""
    out: dict[str, list] = {"reads": [], "writes": [], "lag": [], "gc": []}
    for name in sorted(os.listdir(directory)):
        if name.startswith("gateway-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    for key, rows in json.loads(line).items():
                        out[key].extend(rows)
    return out
