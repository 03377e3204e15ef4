"""What one prefill worker really sustains on the autoscale day, against the planner's capacity.

The planner sizes prefill as computed prompt tokens/s over one worker's tokens/s, and the
simulator gives it ``capacity_of(profile)``: a 2,048-token prompt with no cache hit. This runs
static provisioning on the bench's day and prints the prefill workers' busy share and the
computed tokens per busy second they actually achieved (the day's mix: shorter coding prompts,
prefix hits, long RAG prompts), so the planner's headroom can be read against what it assumes.

Usage: PYTHONPATH=. python benchmarks/probes/autoscale_prefill_capacity.py [--rate 8] [--shape coding]
       [--seed 0] [--period-s 7200] [--workers 6+4]
"""

import argparse

from services.sim import experiments
from services.sim.autoscale import capacity_of
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.day_scale import DayScale
from services.sim.profiles import load_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--shape", default="coding")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--period-s", type=float, default=7200.0)
    ap.add_argument("--workers", default="6+4")
    args = ap.parse_args()
    profile, scale = load_profile("h100"), DayScale(args.period_s)
    prefill, decode = (int(x) for x in args.workers.split("+"))
    trace, _ = experiments.diurnal_day(args.seed, profile, args.rate, scale, args.shape)
    sim = ClusterSim(ClusterConfig(scale.profile(profile), prefill, decode, heartbeat_s=scale.heartbeat_s),
                     trace).run()
    workers = [w for w in sim.workers.values() if w.role == "prefill"]
    busy = sum(w.busy_s for w in workers)
    assumed = capacity_of(profile).prefill_tokens_per_s
    # the router's conditional disaggregation (--disaggregation auto) prefills some prompts on their decode
    # worker: their tokens are in computed_tokens (the planner's prefill demand) but no prefill worker's
    local = sum(j.req.num_tokens for j in sim.jobs if j.local)
    remote = sim.computed_tokens - local
    print(f"{len(trace)} requests, {args.shape} day seed {args.seed}, static {prefill}+{decode}, {sim.loop.now:.0f} s")
    print(f"computed prompt tokens {sim.computed_tokens}: {local / sim.computed_tokens:.3f} of them prefilled on "
          f"decode workers (local), {sum(j.local for j in sim.jobs) / len(sim.jobs):.3f} of the requests")
    print(f"prefill workers busy {busy / (len(workers) * sim.loop.now):.3f} of the day; {remote / busy:.0f} computed "
          f"tokens per busy second; the planner assumes {assumed:.0f} ({remote / busy / assumed:.2f}x)")


if __name__ == "__main__":
    main()
