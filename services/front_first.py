"""``pdserve up --front-first``: the front door asks for a core sooner when it wakes, ahead of the engine (opt-in).

    front_first.apply("gateway", pid)   # [] when set, else one line per thing the kernel refused

On a machine whose cores the engine workers keep busy (decoding flat out, one
thread per core each), the light processes (the gateway, the router, the
embedded Redis) wake for a fraction of a millisecond of work per chunk and
then wait in the run queue behind the engine's threads: ``pdserve bench
frontdoor`` measured the gateway runnable-but-waiting for 29-37 s of each
minute, and the added p99 per chunk at 1,000 open streams at 151 ms on a quiet
2-core machine, against 3.6 ms when the same processes ran in the real-time
class (root). This gives them the same head start without root and without
taking CPU from the engine: each light process asks for
``FRONT_SLICE_NS`` slices (``sched_priority.set_slice``; Linux 6.12+, EEVDF
orders ready threads by a deadline of their wake time plus their slice, and a
woken thread with the shorter slice preempts the running one). Its share of
the cores is unchanged, so the engine keeps all it used. Measured so far
(benchmarks/probes/front_first_wakeup.py, a light process beside two 2-thread
torch processes on 2 cores, paired): wake delay p99 3.3-3.8 ms against 4.4-5.3
ms with the default slice. Whether it brings bench frontdoor's p99 to 20 ms
is not yet measured on a quiet machine (BENCHMARKS.md).

Opt-in (``pdserve up --front-first``, ``StackSpec.front_first``). In the two
bench frontdoor runs with it (load 8-9) 102-136 of 1,500 streams ended with
``No connection available`` from the gateway's Redis pool. What failed them
was redis-py's pool, which lets newcomers overtake a waiting command until its
timeout fails it, however busy the pool is on average (now first come, first
served: services/fair_pool.py), and a stream that had sent its 200 ended on
it (now it waits: gateway/pool_wait.py). A kernel
that refuses or ignores a setting is said once per process and the stack runs
as before.
"""

from __future__ import annotations

from services import sched_priority

FRONT_SLICE_NS = 100_000  # the shortest slice Linux accepts (0.1 ms); its default is 0.75 ms x (1 + log2 cores)
ENGINE = ("prefill", "decode")  # the process names (prefill-0, decode-1, ...) that run the engine


def is_engine(name: str) -> bool:
    return name.startswith(ENGINE)


def apply(name: str, pid: int) -> list[str]:
    """Schedule process ``pid`` (of the stack's process ``name``: a worker, router, gateway, redis) as its role
    wants. Returns what was refused, one line each ([] when all was set)."""
    if is_engine(name):
        return []  # the engine keeps the kernel's defaults: its share of the cores is untouched
    try:
        sched_priority.set_slice(pid, FRONT_SLICE_NS)
    except ProcessLookupError:
        return []  # it already exited; the supervisor says so
    except OSError as exc:
        return [f"front-first scheduling not applied ({exc.strerror or exc})"]
    got = sched_priority.slice_ns(pid)
    if got is not None and got != FRONT_SLICE_NS:
        kept = f"the kernel kept {got / 1e6:g} ms slices: custom slices need Linux 6.12 or later"
        return [f"front-first scheduling not applied ({kept})"]
    return []


def background_engine(name: str, pid: int, niceness: int) -> list[str]:
    """An engine worker's autogroup at ``niceness`` (``pdserve up --engine-nice``, default 19): with
    ``kernel.sched_autogroup_enabled`` each child's session shares the cores as one group, so this, not
    a thread's own niceness, is what lets the light processes run first when they wake. Returns what was
    refused, one line each."""
    if not is_engine(name):
        return []
    try:
        if sched_priority.set_autogroup_nice(pid, niceness):
            return []
        return ["engine niceness not applied (kernel.sched_autogroup_enabled is off, or the process is in a "
                "cgroup of its own: the kernel's scheduling is kept)"]
    except ProcessLookupError:
        return []  # it already exited; the supervisor says so
    except OSError as exc:
        return [f"engine niceness not applied ({exc.strerror or exc})"]


def describe() -> str:
    return (f"the gateway, router and Redis on {FRONT_SLICE_NS / 1e6:g} ms CPU slices because --front-first asks "
            "that they get a core sooner when they wake while the workers compute")
