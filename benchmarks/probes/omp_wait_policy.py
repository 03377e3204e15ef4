"""Batch-1 decode of the engine alone under each libgomp wait policy, alone and beside a busy process.

Why one served stream decoded at ~60% of the engine's batch-1 rate on 2 cores, and why a 2-thread
engine collapsed when other processes shared the cores (engine_threads_shared_cores.py): libgomp's
default wait policy spins an idle OpenMP thread for up to GOMP_SPINCOUNT (300,000) iterations
after each parallel region before sleeping. The engine's Python between kernels and between steps
leaves the second thread spinning on a core the gateway, router, Redis and the decode worker's own
event loop need; when one of them holds that core, the spinning thread waits at the next barrier
for a thread that is not running. Each policy runs in a fresh process (libgomp reads it when it
loads), in turn, twice; the competitor is one process that computes 1 ms in every 4 (what the
serving path's light processes do per token at one stream), or none.

On a machine other processes keep busy, ``nice -n -20`` (root) gives the probe the cores whenever it
wants them, which approximates a quiet machine for it (the competitor inherits the priority).

Usage: PYTHONPATH=. [nice -n -20] python benchmarks/probes/omp_wait_policy.py [--tokens 48] [--rounds 2]
"""

import argparse
import json
import os
import subprocess
import sys
import time

POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin-100": {"GOMP_SPINCOUNT": "100"},
            "spin-1k": {"GOMP_SPINCOUNT": "1000"}, "spin-3k": {"GOMP_SPINCOUNT": "3000"},
            "spin-10k": {"GOMP_SPINCOUNT": "10000"}}


def competitor(stop, burst_s: float = 0.001, period_s: float = 0.004) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < burst_s:
            pass
        time.sleep(period_s - burst_s)


def child(tokens: int) -> None:
    import multiprocessing as mp

    import torch

    from services.bench.hops import prompts
    from services.config import EngineConfig
    from services.engine.bench import pdserve_decode_b1
    from services.engine.engine import Engine

    torch.set_num_threads(2)
    engine = Engine(EngineConfig(quantization="gguf"))
    prompt = engine.tokenizer.encode(prompts(99, 1)[0])[:64]
    pdserve_decode_b1(engine, prompt, 8, "warm")
    out = {}
    for busy in (False, True):
        stop = mp.Event()
        proc = mp.Process(target=competitor, args=(stop,)) if busy else None
        if proc:
            proc.start()
        out["beside a busy process" if busy else "alone"] = pdserve_decode_b1(engine, prompt, tokens, f"r{busy}")
        stop.set()
        if proc:
            proc.join()
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.tokens)
    for r in range(args.rounds):
        for name, env in POLICIES.items():
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
            res = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(args.tokens)], env=env,
                                 capture_output=True, text=True, check=True)
            figures = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {name:9s} " + ", ".join(f"{k}: {v:6.1f} tok/s" for k, v in figures.items())
                  + f"  (load average {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
