"""Probe: how late a light process wakes while engine-like processes keep every core busy, with and without
front_first.py's short slice.

    PYTHONPATH=. python benchmarks/probes/front_first_wakeup.py [--seconds 30] [--engines 2] [--threads 2]

Starts ``--engines`` processes, each in a session of its own as ``pdserve up`` starts its
workers, each running torch matmuls on ``--threads`` threads without pause (the decode and
prefill workers decoding flat out), and beside them two light processes at once, the same
code: each sleeps 2 ms, notes how late it woke (run-queue wait, mostly), then works 0.2 ms
(a gateway's share of a chunk), for ``--seconds``. One asks for front_first.FRONT_SLICE_NS
slices (what ``pdserve up`` gives the gateway, router and Redis); the other keeps the
kernel's default. Both run under the same load at the same time, so the comparison is
paired. Prints one JSON object: per light process, the wake delay's p50 / p99 / max in ms
and its wakeups; and the engines' matmuls per second (what the short slice costs them:
the two runs' figures come from one run here, so compare with ``--light none``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.getcwd())

from services import front_first, sched_priority
from services.bench.stats import percentile


def _engine(threads: int, seconds: float, out) -> None:
    os.setsid()  # a session (autogroup) of its own, as LocalStack's children
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(512, 512)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        a @ a
        n += 1
    out.put(n / seconds)


def _light(short_slice: bool, seconds: float, out) -> None:
    os.setsid()
    if short_slice:
        sched_priority.set_slice(os.getpid(), front_first.FRONT_SLICE_NS)
    late, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        due = time.monotonic() + 0.002
        time.sleep(0.002)
        late.append((time.monotonic() - due) * 1e3)
        spin = time.monotonic() + 0.0002
        while time.monotonic() < spin:
            pass
    out.put({"short_slice": short_slice, "slice_ns": sched_priority.slice_ns(os.getpid()), "wakeups": len(late),
             "late_ms_p50": round(percentile(late, 50), 3), "late_ms_p99": round(percentile(late, 99), 3),
             "late_ms_max": round(max(late), 3)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--light", choices=["both", "none"], default="both",
                   help="none: the engines alone, for their matmul rate without the light processes")
    args = p.parse_args()
    ctx = mp.get_context("fork")
    rates, lights = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_engine, args=(args.threads, args.seconds, rates)) for _ in range(args.engines)]
    if args.light == "both":
        procs += [ctx.Process(target=_light, args=(s, args.seconds - 2, lights)) for s in (True, False)]
    for proc in procs:
        proc.start()
    got_lights = [lights.get() for _ in range(2)] if args.light == "both" else []
    got_rates = [rates.get() for _ in range(args.engines)]
    for proc in procs:
        proc.join()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(json.dumps({"engines": args.engines, "threads": args.threads, "seconds": args.seconds,
                      "engine_matmuls_per_s": [round(r, 1) for r in got_rates], "light": got_lights,
                      "loadavg_after": load}))


if __name__ == "__main__":
    main()
