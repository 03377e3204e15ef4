"""Why ``bench sim --profile h100-measured`` runs slower than ``--profile h100``: the block size.

The measured profile keeps the engine's 16-token KV blocks (the derived one assumed 64), so every
prompt carries 4x the block hashes and the router's prefix index (overlaps, touch, store) does 4x the
work per request. This runs the same policy part on the measured profile as it is and with its blocks
made 64 tokens (the same KV tokens), and on the derived profile, and prints CPU seconds and hashes.

    python benchmarks/probes/sim_block_size_cost.py [--requests 20000] [--policy kv-aware]
"""

import argparse
import dataclasses
import time

from services.sim.experiments import run_policies, scale_workload
from services.sim.metrics import SLO
from services.sim.profiles import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--policy", default="kv-aware")
    args = p.parse_args()
    measured = load_profile("h100-measured")
    variants = {
        "h100 (derived, 64-token blocks)": load_profile("h100"),
        "h100-measured (16-token blocks)": measured,
        "h100-measured, blocks of 64": dataclasses.replace(measured, block_size=64, kv_blocks=measured.kv_blocks // 4),
    }
    prefill = round(args.workers * 0.25)
    for name, profile in variants.items():
        reqs = scale_workload(1, profile, args.workers, args.requests, 0.3)
        hashes = sum(len(r.hashes) for r in reqs) / len(reqs)
        cpu = time.process_time()
        out = run_policies(profile, reqs, prefill, args.workers - prefill, SLO(2.0, 0.05), policies=(args.policy,))
        r = out[args.policy]
        print(f"{name:34s} hashes/request {hashes:6.1f}  CPU {time.process_time() - cpu:6.1f} s  "
              f"hit rate {r['hit_rate']:.3f}  p99 TTFT {r['ttft_s']['p99']:.3f} s", flush=True)


if __name__ == "__main__":
    main()
