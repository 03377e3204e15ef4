"""Where one streaming user's CPU goes, per process and per thread: `pdserve up`'s stack on the
default model's GGUF file (2 threads), one chat stream of 1,500 tokens, /proc per-thread CPU over
8 s (psutil); with --py-spy DIR also a py-spy raw profile of the gateway, decode worker and router (10 s).

    python benchmarks/probes/batch1_thread_cpu.py [--py-spy OUT_DIR]

Explains the fourteenth session's batch-1 notes in BENCHMARKS.md ("bench hops").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time

import httpx
import psutil

from services.launcher import LocalStack, StackSpec


def thread_cpu_s(pid: int) -> dict[int, float]:
    """Thread id -> CPU seconds so far (user + system), every thread of ``pid``."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--py-spy", metavar="DIR", help="also record py-spy raw profiles into DIR")
    ap.add_argument("--tokens", type=int, default=1500)
    args = ap.parse_args()
    with LocalStack(StackSpec(prefill=1, decode=1, quantization="gguf", threads=2)) as stack:
        url = f"http://{stack.gateway_address}/v1/chat/completions"

        def stream(n: int) -> None:
            body = {"messages": [{"role": "user", "content": "Write a long story about a robot."}],
                    "max_tokens": n, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url, json=body, timeout=300) as reply:
                for _ in reply.iter_lines():
                    pass

        stream(200)  # warm
        pids = {name: p.proc.pid for name, p in stack.procs.items()}
        user = threading.Thread(target=stream, args=(args.tokens,))
        user.start()
        time.sleep(1)
        before = {name: thread_cpu_s(pid) for name, pid in pids.items()}
        started = time.monotonic()
        spies = []
        if args.py_spy:
            os.makedirs(args.py_spy, exist_ok=True)
            spies = [subprocess.Popen(["py-spy", "record", "-p", str(pids[name]), "-d", "10", "-r", "200", "-f", "raw",
                                       "--threads", "-o", os.path.join(args.py_spy, f"{name}.txt")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for name in ("gateway", "decode-0", "router")]
        time.sleep(8)
        after = {name: thread_cpu_s(pid) for name, pid in pids.items()}
        seconds = time.monotonic() - started
        for name in pids:
            per_thread = sorted(((after[name][t] - before[name].get(t, 0)) * 1e3 / seconds, t)
                                for t in after[name])[::-1]
            total = sum(ms for ms, _ in per_thread)
            busiest = ", ".join(f"{ms:.0f}" for ms, _ in per_thread[:4] if ms)
            print(f"{name}: {total:.0f} ms/s of CPU (busiest threads: {busiest} ms/s)")
        for spy in spies:
            spy.wait()
        user.join()


if __name__ == "__main__":
    main()
