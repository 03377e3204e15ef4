"""A ``pdserve bench`` stopped with SIGTERM (``timeout 400 pdserve bench ...``, as benchmarks/probes/hops_ab.sh
runs it) stops the stack it started: left running, its workers took the cores of every later run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow


def test_a_bench_killed_by_sigterm_leaves_no_process_behind(tmp_path):
    bench = subprocess.Popen([sys.executable, "-m", "services.cli", "bench", "hops", "--concurrency", "1",
                              "--requests", "2", "--kv-cache-gb", "0.1", "--engine-nice", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        parent = psutil.Process(bench.pid)
        deadline = time.monotonic() + 120
        stack: list[psutil.Process] = []
        while time.monotonic() < deadline:  # every process of its stack started (they load while we wait)
            stack = parent.children(recursive=True)
            roles = " ".join(" ".join(p.cmdline()[3:4]) for p in stack if len(p.cmdline()) > 3)
            if all(role in roles for role in ("prefill", "decode", "router", "gateway")):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the bench's stack did not start")
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(90) == 143
        _, alive = psutil.wait_procs(stack, timeout=30)
        assert not alive, f"left running: {[p.cmdline()[:4] for p in alive]}"
    finally:
        if bench.poll() is None:
            bench.kill()
