"""Probe: the autoscale day hour by hour (24 bins of the compressed day), for a static provisioning or the
planner: each hour's requests, their SLO attainment (both SLOs, and TTFT alone), the prompt tokens computed
per request (not cache hits), the prefill and decode workers the hour held on average and the prefill
workers' busy share, and the decode workers' KV use; and the attainment of the requests that arrived in each of
the day's bursts. Run to the end (no early stop), so a static point's
worst hour is seen, not only its day's share of misses.

    PYTHONPATH=. python benchmarks/probes/autoscale_hourly.py static 17+8 [--rate 32] [--seed 1]
    PYTHONPATH=. python benchmarks/probes/autoscale_hourly.py planner '{"target_utilisation": 0.6}'
        [--router '{"load_weight": 0.1}'] [--spill-blocks 12000 --router '{"restore_token_cost": 0.16}']

Prints one line per hour and the day's totals; with ``--json FILE``, the rows as JSON too.
"""

import argparse
import json
import time

from autoscale_day import load_day_and_arrivals

from services.bench import results
from services.planner.policy import PlannerConfig
from services.sim import experiments
from services.sim.autoscale import SimAutoscaler
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.metrics import SLO, ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("static", "planner"))
    ap.add_argument("what", help="static: P+D; planner: PlannerConfig fields as JSON")
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--shape", default="coding")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--router", default="{}", help="RouterPolicyConfig fields as JSON (load_weight 0.1)")
    ap.add_argument("--spill-blocks", type=int, default=0,
                    help="each prefill worker's spill tier, in blocks (ClusterConfig.prefill_spill_blocks; 0: none)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    base, scale, trace, arrivals = load_day_and_arrivals(args)
    profile, slo = scale.profile(base), SLO(2.0, 0.05)
    router = json.loads(args.router)
    start = time.process_time()
    if args.kind == "static":
        p, d = (int(x) for x in args.what.split("+"))
        sim = ClusterSim(ClusterConfig(profile, p, d, heartbeat_s=scale.heartbeat_s, policy_options=router,
                                       prefill_spill_blocks=args.spill_blocks), experiments._fresh(trace))
        scaler = None
    else:
        config = scale.planner(PlannerConfig(**json.loads(args.what)), base.cold_start_s)
        sim = ClusterSim(ClusterConfig(profile, 1, 1, heartbeat_s=scale.heartbeat_s, policy_options=router,
                                       prefill_spill_blocks=args.spill_blocks), experiments._fresh(trace))
        scaler = SimAutoscaler("planner", profile, slo, interval_s=scale.tick_s, planner_config=config)
        scaler.attach(sim)
    # each sample also records the prefill workers' busy seconds so far (the retired ones' included)
    sample = sim.sample

    def sampled():
        row = sample()
        row["prefill_busy"] = sum(w.busy_s for w in list(sim.workers.values()) + sim.retired if w.role == "prefill")
        row["prefill_ready"] = sum(1 for w in sim.workers.values()
                                   if w.role == "prefill" and w.ready_at <= sim.loop.now and not w.draining)
        return row

    sim.sample = sampled
    sim.run()
    hour = scale.period_s / 24
    rows = []
    for h in range(24):
        jobs = [j for j in sim.jobs if h * hour <= j.req.arrival < (h + 1) * hour and j.finished_at > 0]
        series = [s for s in sim.series if h * hour <= s["t"] < (h + 1) * hour]
        if not jobs or len(series) < 2:
            continue
        busy = series[-1]["prefill_busy"] - series[0]["prefill_busy"]
        ready_s = sum(s["prefill_ready"] for s in series[:-1]) * sim.config.sample_s
        rows.append({
            "hour": h, "requests": len(jobs),
            "attainment": round(sum(slo.met(j) for j in jobs) / len(jobs), 4),
            "ttft_attainment": round(sum(ttft(j) <= slo.ttft_s for j in jobs) / len(jobs), 4),
            "computed_per_request": round(sum(j.req.num_tokens - j.cached_tokens for j in jobs) / len(jobs)),
            "prompt_per_request": round(sum(j.req.num_tokens for j in jobs) / len(jobs)),
            "fetched_per_request": round(sum(j.extra.get("fetched_blocks", 0) for j in jobs)
                                         * profile.block_size / len(jobs)),
            "restored_per_request": round(sum(j.extra.get("restored_blocks", 0) for j in jobs)
                                          * profile.block_size / len(jobs)),
            "prefill_workers": round(sum(s["prefill_workers"] for s in series) / len(series), 2),
            "decode_workers": round(sum(s["decode_workers"] for s in series) / len(series), 2),
            "prefill_busy_share": round(busy / ready_s, 3) if ready_s else None,
            "kv_usage": round(sum(s["kv_usage"] for s in series) / len(series), 3),
            "kv_usage_max": max(s["kv_usage"] for s in series)})
    done = [j for j in sim.jobs if j.finished_at > 0]
    # the day's bursts (burst_factor x the diurnal rate for burst_s): the requests that arrived in each
    bursts = []
    for begin, end in arrivals.bursts:
        jobs = [j for j in done if begin <= j.req.arrival < end]
        bursts.append({"start_s": round(begin, 1), "end_s": round(end, 1), "requests": len(jobs),
                       "attainment": round(sum(slo.met(j) for j in jobs) / len(jobs), 4) if jobs else None})
    total = {"requests": len(done), "attainment": round(sum(slo.met(j) for j in done) / len(done), 4),
             "worst_hour": min(rows, key=lambda r: r["attainment"]) if rows else None, "bursts": bursts,
             "cpu_s": round(time.process_time() - start)}
    if scaler is not None:
        total["worker_hours"] = round(scaler.worker_seconds / 3600, 3)
        total["by_state"] = {k: round(v / 3600, 3) for k, v in sorted(scaler.breakdown.items())}
    else:
        total["worker_hours"] = round((p + d) * sim.loop.now / 3600, 3)
    print(f"{args.kind} {args.what} router {args.router}: {len(trace)} requests, {args.shape} day seed {args.seed}, "
          f"rate {args.rate:g}")
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(total), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results.record("autoscale_hourly", {"args": vars(args), "hours": rows, "total": total}), f,
                      indent=1)


if __name__ == "__main__":
    main()
