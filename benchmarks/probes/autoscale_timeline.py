"""Probe: the planner's day tick by tick, next to its TTFT misses: per tick, the signals the planner read
(prefill tokens/s computed, queued prefill tokens, prefill workers active and still starting, KV in use),
what it decided and why, the warm pool, and the requests that arrived in the tick and missed TTFT.
Written as JSON lines to stdout's file; the summary (the ticks of the most misses, with the ticks before
them) to stderr. One simulated day (~8 CPU-minutes at 32 session starts/s).

    PYTHONPATH=. python benchmarks/probes/autoscale_timeline.py coding 1 '{"target_utilisation": 0.8}' \
        --rate 32 [--router '{"load_weight": 0.1}'] > timeline.jsonl
"""

import argparse
import json
import sys
from collections import Counter

from autoscale_day import add_day_arguments, load_day

from services.planner.policy import PlannerConfig
from services.sim import experiments
from services.sim.autoscale import SimAutoscaler
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.metrics import SLO, ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    add_day_arguments(ap, rate=32.0, config_help="PlannerConfig fields as JSON")
    ap.add_argument("--router", default="{}", help="RouterPolicyConfig fields as JSON (load_weight 0.1)")
    ap.add_argument("--until", type=float, default=0.0,
                    help="only the requests that arrive before this simulated second (0: the whole day)")
    args = ap.parse_args()
    base, scale, trace = load_day(args)
    if args.until:
        trace = [r for r in trace if r.arrival < args.until]
    config = scale.planner(PlannerConfig(**json.loads(args.config)), base.cold_start_s)
    profile, slo = scale.profile(base), SLO(2.0, 0.05)
    sim = ClusterSim(ClusterConfig(profile, 1, 1, heartbeat_s=scale.heartbeat_s,
                                       policy_options=json.loads(args.router)), experiments._fresh(trace))
    scaler = SimAutoscaler("planner", profile, slo, interval_s=scale.tick_s, planner_config=config)
    seen = []
    decide = scaler.planner.decide

    def logged(s):
        d = decide(s)
        seen.append({"t": round(s.now, 2), "p_active": s.prefill_workers, "p_starting": s.prefill_starting,
                     "d_active": s.decode_workers, "tok_s": round(s.prefill_tokens_per_s),
                     "queued": round(s.queued_prefill_tokens), "kv": s.kv_blocks_used,
                     "ttft_att": s.ttft_attainment, "prefill": d.prefill, "decode": d.decode, "warm_target": d.warm,
                     "warm": scaler.warm, "reason": d.reason})
        return d

    scaler.planner.decide = logged
    scaler.attach(sim)
    sim.run()
    done = [j for j in sim.jobs if j.finished_at > 0]
    tick = scale.tick_s
    arrived = Counter(int(j.req.arrival // tick) for j in done)
    missed = Counter(int(j.req.arrival // tick) for j in done if ttft(j) > slo.ttft_s)
    for row in seen:
        i = int(row["t"] // tick) - 1  # the tick's decision reads the window before it
        row.update(arrived=arrived.get(i, 0), missed=missed.get(i, 0))
        print(json.dumps(row))
    total = sum(missed.values())
    both = sum(not slo.met(j) for j in done)
    print(f"{len(done)} finished; TTFT missed {total} ({total / len(done):.4f}); either SLO missed {both} "
          f"(attainment {1 - both / len(sim.jobs):.4f}); worker-h "
          f"{scaler.worker_seconds / 3600:.3f}; by state "
          f"{ {k: round(v / 3600, 3) for k, v in sorted(scaler.breakdown.items())} }", file=sys.stderr)


if __name__ == "__main__":
    main()
