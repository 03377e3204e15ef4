"""What Python's cyclic garbage collector costs a simulated day, and what pausing it saves.

The simulator keeps the collector off while it builds a day and while its event loop runs
(``services.sim.events.collector_paused``). This runs the planner's day (the bench's coding trace,
``h100-measured``) to ``--until`` simulated seconds, the collector paused as the simulator does or, with
``--collector on``, left on as before, and prints one JSON line: CPU seconds to build the day, to copy
it and to run it, the collections by generation and their seconds, the objects a collection would walk
when the run starts (frozen ones are not), and a digest of every request's outcome (the same in both modes: the collector changes how
fast a run goes, never what it does).

    python benchmarks/probes/sim_gc_cost.py --collector on --until 2400
    python benchmarks/probes/sim_gc_cost.py --collector paused --until 2400
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import platform
import resource
import time

from services.planner.policy import PlannerConfig
from services.sim import cluster, events, experiments, workloads
from services.sim.autoscale import SimAutoscaler
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.day_scale import DayScale
from services.sim.metrics import SLO
from services.sim.profiles import load_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collector", choices=("paused", "on"), default="paused")
    ap.add_argument("--until", type=float, default=2400.0, help="simulated seconds of the 7,200 s day to run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--profile", default="h100-measured")
    args = ap.parse_args()
    if args.collector == "on":  # the simulator as it was: every pause a no-op
        for module in (events, workloads, experiments, cluster):
            module.collector_paused = contextlib.nullcontext

    collections, started = [[0, 0.0] for _ in range(3)], {}

    def timed(phase, info):
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        else:
            collections[info["generation"]][0] += 1
            collections[info["generation"]][1] += time.perf_counter() - started[info["generation"]]

    gc.callbacks.append(timed)
    profile, scale = load_profile(args.profile), DayScale(7200)
    cpu = time.process_time()
    trace, _ = experiments.diurnal_day(args.seed, profile, args.rate, scale)
    build_s, cpu = time.process_time() - cpu, time.process_time()
    requests = experiments._fresh(trace)
    copy_s = time.process_time() - cpu
    (config,) = experiments.planner_variants(profile, scale, [PlannerConfig.target_utilisation],
                                             PlannerConfig.target_utilisation, False, {}).values()
    sim = ClusterSim(ClusterConfig(scale.profile(profile), 1, 1, heartbeat_s=scale.heartbeat_s), requests)
    SimAutoscaler("planner", scale.profile(profile), SLO(2.0, 0.05), interval_s=scale.tick_s,
                  planner_config=config).attach(sim)
    tracked = len(gc.get_objects())
    cpu = time.process_time()
    sim.run(until=args.until)
    run_s = time.process_time() - cpu
    digest = hashlib.sha256(json.dumps([(j.req.id, j.prefill_worker, j.decode_worker, round(j.first_token_at, 9),
                                         round(j.finished_at, 9)) for j in sim.jobs]).encode()).hexdigest()[:16]
    print(json.dumps({
        "collector": args.collector, "until_s": args.until, "seed": args.seed, "rate": args.rate,
        "profile": args.profile, "requests_arrived": len(sim.jobs), "events": sim.loop.events_run,
        "cpu_s": {"build_day": round(build_s, 1), "copy_day": round(copy_s, 1), "run": round(run_s, 1)},
        "collections": {f"gen{g}": {"count": n, "s": round(s, 1)} for g, (n, s) in enumerate(collections)},
        "tracked_objects_at_start": tracked,
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "outcome_digest": digest, "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
    }))


if __name__ == "__main__":
    main()
