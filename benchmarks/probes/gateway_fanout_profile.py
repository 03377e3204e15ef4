"""Probe: where the gateway's CPU goes with 1,000 open streams, by py-spy samples of its process.

    PYTHONPATH=. python benchmarks/probes/gateway_fanout_profile.py [bench frontdoor flags...]

Runs ``pdserve bench frontdoor --clients 200 --latency-streams 1000 --latency-requests
1500 --json`` (plus the flags given), waits for its added-latency phase, then samples the
gateway (the bench's child running ``services.cli gateway``) with ``py-spy record`` for 25 s
at 50 Hz without stopping it, and prints the frames with the most samples: on their own
(self) and with what they call (inclusive). Needs py-spy (``pip install py-spy``) and the
right to trace a child process (root, or ptrace_scope 0).

What it showed on the 2-core Xeon (load 7-10, main 368e16a, the stdlib loop): 20% of the
gateway's samples in the stdlib loop's socket write, 16% in each new stream's own catch-up
round trip (a pooled connection, an XRANGE), 8% waiting on the Redis pool's condition;
BENCHMARKS.md (``bench frontdoor``) has the figures before and after the changes that
followed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def gateway_child(parent: int) -> int | None:
    found = subprocess.run(["pgrep", "-P", str(parent), "-f", "services.cli gateway"], capture_output=True, text=True)
    pids = found.stdout.split()
    return int(pids[0]) if pids else None


def top_frames(raw: Path, n: int = 25) -> tuple[int, Counter, Counter]:
    total, own, incl = 0, Counter(), Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        count = int(count)
        total += count
        frames = stack.split(";")
        own[frames[-1]] += count
        for frame in set(frames):
            incl[frame] += count
    return total, own, incl


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="pdserve-fanout-profile-"))
    err = open(work / "bench.err", "w")
    bench = subprocess.Popen([sys.executable, "-m", "services.cli", "bench", "frontdoor", "--clients", "200",
                              "--latency-streams", "1000", "--latency-requests", "1500", "--json", *sys.argv[1:]],
                             stdout=open(work / "bench.json", "w"), stderr=err, env=os.environ)
    while "added latency:" not in (work / "bench.err").read_text():
        if bench.poll() is not None:
            sys.exit(f"the bench ended early:\n{(work / 'bench.err').read_text()[-2000:]}")
        time.sleep(0.5)
    gateway = gateway_child(bench.pid)
    if gateway is None:
        sys.exit("no gateway child found")
    time.sleep(5)  # every stream open
    raw = work / "gateway.spy"
    subprocess.run(["py-spy", "record", "-p", str(gateway), "-d", "25", "-r", "50", "--nonblocking", "-f", "raw",
                    "-o", str(raw)], capture_output=True, check=True)
    bench.wait()
    total, own, incl = top_frames(raw)
    print(f"{total} samples of the gateway; bench output in {work}")
    print("self:")
    for frame, count in own.most_common(25):
        print(f"  {100 * count / total:5.1f}%  {frame[:140]}")
    print("inclusive:")
    for frame, count in incl.most_common(40):
        print(f"  {100 * count / total:5.1f}%  {frame[:140]}")


if __name__ == "__main__":
    main()
