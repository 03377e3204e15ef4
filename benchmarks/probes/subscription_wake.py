"""Probe: the gateway's loop time per chunk to wake a stream's follower, ``asyncio.wait_for`` against a bare future.

    PYTHONPATH=. python benchmarks/probes/subscription_wake.py [--streams 1000] [--rounds 20] [--loop uvloop]

``STREAMS`` followers each wait in ``Subscription.next`` (delivery.py) as the
gateway's streams do; each round pushes one chunk to every one of them at once
(what one delivery read hands the loop, in bigger batches) and waits until every
follower has taken its chunk. Printed: CPU time of this process per chunk
delivered (median of 5 runs), for the old wait (``asyncio.wait_for`` on an
``asyncio.Event``, a task per call on Python 3.11) and the current one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from services import event_loop
from services.gateway.delivery import Subscription


class WaitForSubscription(Subscription):
    """The wait as it was before: an Event and asyncio.wait_for."""

    def __init__(self, request_id: str, last_id: str):
        super().__init__(request_id, last_id)
        self._wake = asyncio.Event()

    def _accept(self, events):
        super()._accept(events)
        if self._ready:
            self._wake.set()

    async def next(self, timeout_s: float):
        if not self._ready:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout_s)
        events, self._ready = self._ready, []
        return events


async def cpu_per_chunk(kind: type[Subscription], streams: int, rounds: int) -> float:
    subs = [kind(f"r{i}", "0") for i in range(streams)]
    taken = asyncio.Queue()

    async def follow(sub: Subscription) -> None:
        while True:
            if await sub.next(15.0):
                taken.put_nowait(None)

    tasks = [asyncio.create_task(follow(s)) for s in subs]
    await asyncio.sleep(0)
    started = time.process_time()
    for r in range(1, rounds + 1):
        for sub in subs:
            sub.push((f"{r}-0", "chunk", {"text": "x"}))
        for _ in subs:
            await taken.get()
    spent = time.process_time() - started
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return spent / (streams * rounds)


async def main(args) -> None:
    for name, kind in (("asyncio.wait_for + Event (before)", WaitForSubscription), ("bare future (now)", Subscription)):
        runs = sorted([await cpu_per_chunk(kind, args.streams, args.rounds) for _ in range(5)])
        print(f"{name:36s} {runs[2] * 1e6:6.1f} us CPU per chunk ({args.streams} streams, loop {args.loop})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--loop", choices=event_loop.LOOPS, default="auto")
    a = p.parse_args()
    event_loop.run(main(a), a.loop)
