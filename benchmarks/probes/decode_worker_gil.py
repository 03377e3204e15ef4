"""Where the decode worker's threads hold the GIL while one user streams (issue 27's batch-1 gap).

One stream, ``pdserve up``'s shape (1 prefill + 1 decode, GGUF weights, 2 threads, local prefill of short
prompts), 400-token completions back to back from the shared load generator, while py-spy samples the decode
worker with ``--gil`` (only the thread holding the GIL is recorded) for 10 s. Prints the served rate, each
request's time per output token, and each process's CPU time per served token; the raw py-spy samples go
to the file named. Summarize it by thread and frame (BENCHMARKS.md, bench hops' "Tenth session" reading):
the engine thread should hold the GIL only between kernels; whatever the event-loop thread holds per token
is time the engine may wait for.

Usage: PYTHONPATH=. python benchmarks/probes/decode_worker_gil.py OUT.txt [PROCESS]   (needs py-spy, root)

PROCESS (default decode-0) names another process of the stack (gateway, router): it is sampled on CPU
(``--gil`` is for the decode worker's two threads), which is where its time per served token goes.
"""

import asyncio
import os
import subprocess
import sys

from services import openmp_env

openmp_env.apply()

from services.bench.load import OpenAIClient, OpenAIRequest, closed_loop  # noqa: E402
from services.launcher import LocalStack, StackSpec  # noqa: E402
from services.up_defaults import LOCAL_PREFILL_MAX_TOKENS  # noqa: E402


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(out: str, process: str = "decode-0") -> None:
    spec = StackSpec(prefill=1, decode=1, kv_cache_gb=0.25, quantization="gguf", threads=2,
                     router_args=[f"--local-prefill-max-tokens={LOCAL_PREFILL_MAX_TOKENS}"])
    with LocalStack(spec) as stack:
        host, port = stack.gateway_address.rsplit(":", 1)
        client = OpenAIClient(host, int(port), "SmolLM2-135M-Instruct")
        items = [OpenAIRequest("chat", f"story {i} about rivers and stones", 400, extra={"ignore_eos": True})
                 for i in range(6)]
        asyncio.run(closed_loop(client.send, items[:2], clients=1))  # warm
        pids = {name: p.proc.pid for name, p in stack.procs.items()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(pids[process]), "-d", "10", "-r", "250",
                                "-f", "raw", "-o", out, "--threads",
                                *(["--gil"] if process == "decode-0" else [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples, wall = asyncio.run(closed_loop(client.send, items, clients=1))
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        tokens = sum(s.tokens for s in samples)
        print(f"served {tokens / wall:.1f} tok/s; TPOT ms",
              [round((s.e2e - s.ttft) / (s.tokens - 1) * 1e3, 2) for s in samples])
        print("CPU ms per served token:", {n: round((after[n] - before[n]) / tokens * 1e3, 3) for n in pids})
        spy.wait()


if __name__ == "__main__":
    main(*sys.argv[1:3])
