"""Where the planner day's TTFT misses come from: each request joined to its prefill worker (the worker's age
when it took the request, the request's cache hit, its wait before dispatch and its prefill after), missed
against met, by fifth of the day; and how clustered the misses are in time.

Used for BENCHMARKS.md, "Autoscaling, fourteenth session". One simulated day (~3 min on a quiet core).

Usage: PYTHONPATH=. python benchmarks/probes/autoscale_ttft_misses.py coding 1 '{"target_utilisation": 0.8}'
"""

import argparse
import json
from collections import Counter
from statistics import mean, median

from autoscale_day import add_day_arguments, load_day

from services.planner.policy import PlannerConfig
from services.sim import experiments
from services.sim.autoscale import SimAutoscaler
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.metrics import SLO, ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    add_day_arguments(ap, config_help="PlannerConfig fields as JSON (target_utilisation 0.9)")
    args = ap.parse_args()
    base, scale, trace = load_day(args)
    config = scale.planner(PlannerConfig(**{"target_utilisation": 0.9, **json.loads(args.config)}), base.cold_start_s)
    profile, slo = scale.profile(base), SLO(2.0, 0.05)
    sim = ClusterSim(ClusterConfig(profile, 1, 1, heartbeat_s=scale.heartbeat_s), experiments._fresh(trace))
    scaler = SimAutoscaler("planner", profile, slo, interval_s=scale.tick_s, planner_config=config)
    scaler.attach(sim)
    sim.run()
    workers = {w.worker_id: w for w in [*sim.workers.values(), *sim.retired]}
    done = [j for j in sim.jobs if j.finished_at > 0]
    late = sum(ttft(j) > slo.ttft_s for j in done)
    print(f"{args.shape} seed {args.seed} {args.config}: {len(done)} finished of {len(sim.jobs)}; "
          f"TTFT missed {late}, ITL missed {sum(not slo.met(j) for j in done) - late} (ITL alone)")
    span = scale.period_s / 5
    print(f"{'from s':>7}{'side':>7}{'n':>7}{'wait s':>8}{'prefill s':>10}{'hit':>6}{'prompt':>8}{'age<30s':>8}"
          f"{'local':>7}{'same-worker share':>19}")
    for b in range(5):
        jobs = [j for j in done if b * span <= j.req.arrival < (b + 1) * span]
        for side, group in (("missed", [j for j in jobs if ttft(j) > slo.ttft_s]),
                            ("met", [j for j in jobs if ttft(j) <= slo.ttft_s])):
            if not group:
                continue
            ages = [j.dispatched_at - workers[j.prefill_worker].ready_at for j in group
                    if j.prefill_worker in workers]
            top = Counter(j.prefill_worker for j in group).most_common(1)[0][1] / len(group)
            print(f"{b * span:>7.0f}{side:>7}{len(group):>7}{mean(j.dispatched_at - j.req.arrival for j in group):>8.2f}"
                  f"{mean(j.first_token_at - j.dispatched_at for j in group):>10.2f}"
                  f"{sum(j.cached_tokens for j in group) / max(1, sum(j.req.num_tokens for j in group)):>6.2f}"
                  f"{mean(j.req.num_tokens for j in group):>8.0f}"
                  f"{(sum(a < 30 for a in ages) / len(ages) if ages else 0):>8.2f}"
                  f"{sum(j.local for j in group) / len(group):>7.2f}{top:>19.2f}")
    missed_at = sorted(j.req.arrival for j in done if ttft(j) > slo.ttft_s)
    if missed_at:
        by_10s = Counter(int(t // 10) for t in missed_at)
        gap = median(b - a for a, b in zip(missed_at, missed_at[1:])) if len(missed_at) > 1 else 0.0
        print("misses in their busiest 10 s windows:", by_10s.most_common(8),
              f"; windows with any: {len(by_10s)}; median gap {gap:.1f} s")


if __name__ == "__main__":
    main()
