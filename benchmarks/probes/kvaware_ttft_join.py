"""Which requests the simulator makes too fast: simulated and real TTFT joined per request.

``pdserve bench routing`` saves every request's TTFT in send order (``ttft_ms``), and the
validation simulates the very same requests on the same seeds (``validation.py``), so
request i of one side is request i of the other. This probe runs the validation's
simulation of every seed in the calibration file's reference (or of the files given)
and joins the two per request, then splits the gap (simulated less real) by what the
simulator says happened to the request:

* ``phase``: the cold opening (the first ``--cold`` requests, which meet the 8 uncached
  system prompts) or the steady state after it;
* ``hit``: whether its system prompt was cached where it was prefilled (a prefix hit) or
  computed (a miss), and its prefill worker;
* ``queue``: what it waited for on the prefill worker (dispatch to admission into a step,
  from the simulator), in bins.

It prints, per group, the request count, the mean real and simulated TTFT and the mean
gap, and for the steady state the simulated TTFT's parts (front door + dispatch, prefill
queue, prefill compute, KV hand-off, decode step wait). With ``--json OUT`` the per-request
rows go to a file.

Usage: PYTHONPATH=. python benchmarks/probes/kvaware_ttft_join.py [routing-*.json ...]
       [--policy kv-aware] [--cold 24] [--json OUT]
"""

import argparse
import json
from pathlib import Path

from services.bench.stats import mean, percentile
from services.sim.profiles import CALIBRATION, load_profile
from services.sim.routing_reference import other_cores
from services.sim.validation import bench_run, simulated_requests


def real_runs(files: list[str]) -> dict[int, dict]:
    """seed -> policy -> the saved summary (with ``ttft_ms`` in send order)."""
    out: dict[int, dict] = {}
    for path in files:
        result = json.loads(Path(path).read_text())["result"]
        for rep in result["repeats"]:
            out.setdefault(rep["seed"], {}).update(rep["policies"])
    return out


def rows_for(seed: int, real: dict, profile, policy: str, cold: int) -> list[dict]:
    requests, exact = simulated_requests(seed, profile.block_size)
    if not exact:
        raise SystemExit("the default model's tokenizer did not load: the join needs the bench's own requests")
    # the cores other tenants took: measured, or (seeds 0-2) estimated as the validation's reference does
    sim = bench_run(profile, requests, policy, other_cores(real, profile.host_cores)[0])
    jobs = sorted(sim.jobs, key=lambda j: j.req.id)
    real_ttft = real["ttft_ms"]
    if len(real_ttft) != len(jobs) or real.get("errors"):
        raise SystemExit(f"seed {seed} {policy}: {len(real_ttft)} real TTFTs (errors {real.get('errors')}) "
                         f"for {len(jobs)} requests: the join needs every request")
    # after the first token: with 8 requests always in flight a request's mean time in the system is 8 / its
    # rate (Little), so the time after its first token is that less the mean TTFT, on each side alike
    sim_rate = len(jobs) / max(j.finished_at for j in jobs)
    sim_ttft, real_ttft_mean = mean(j.first_token_at - j.req.arrival for j in jobs), mean(real_ttft) / 1e3
    print(f"seed {seed} {policy}: after the first token (8 / rate - mean TTFT): real "
          f"{8 / real['requests_per_s'] - real_ttft_mean:.3f} s, simulated {8 / sim_rate - sim_ttft:.3f} s "
          f"(its own jobs: {mean(j.finished_at - j.first_token_at for j in jobs):.3f} s); rate real "
          f"{real['requests_per_s']:.2f}, simulated {sim_rate:.2f} /s")
    rows = []
    # the real split where the run saved it (bench routing since router_ttft_ms / prefill_ms per request)
    n = len(real_ttft)
    router, prefill = real.get("router_ttft_ms") or [None] * n, real.get("prefill_ms") or [None] * n
    for j, r, r_router, r_prefill in zip(jobs, real_ttft, router, prefill):
        prefilled = j.extra.get("prefilled_at", j.first_token_at)
        split = {} if r_router is None or r_prefill is None else {
            "real_client_ms": round(r - r_router, 1), "real_prefill_ms": r_prefill,
            "real_handoff_ms": round(r_router - r_prefill, 1)}
        rows.append({**split,
            "seed": seed, "id": j.req.id, "tokens": j.req.num_tokens, "cached": j.cached_tokens,
            "hit": j.cached_tokens >= 512, "worker": j.prefill_worker, "cold": j.req.id < cold,
            "real_ms": r, "sim_ms": round((j.first_token_at - j.req.arrival) * 1e3, 1),
            # the simulated TTFT's parts
            "queue_ms": round((j.extra.get("admitted_at", j.dispatched_at) - j.dispatched_at) * 1e3, 1),
            "prefill_ms": round((prefilled - j.extra.get("admitted_at", j.dispatched_at)) * 1e3, 1),
            "handoff_ms": round((j.first_token_at - prefilled) * 1e3, 1),
            "front_ms": round((j.dispatched_at - j.req.arrival) * 1e3, 1)})
    return rows


def grouped(rows: list[dict], key) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return groups


def split_table(rows: list[dict], key, label: str) -> None:
    """Real against simulated per part: the prefill worker's span (real: its Prefill time, queue + compute
    + KV send; simulated: dispatch to prefilled) and the rest (real: the router's hand-off and the client
    hop; simulated: the KV transfer and the decode step's end)."""
    rows = [r for r in rows if "real_prefill_ms" in r]
    if not rows:
        return
    groups = grouped(rows, key)
    print(f"\n{label:<28} {'n':>5} {'prefill real':>13} {'sim':>6} {'hand-off real':>14} {'sim':>6}"
          f" {'client real':>12}")
    for k in sorted(groups, key=str):
        g = groups[k]
        print(f"{k!s:<28} {len(g):>5} {mean(r['real_prefill_ms'] for r in g):>13.0f}"
              f" {mean(r['queue_ms'] + r['prefill_ms'] for r in g):>6.0f}"
              f" {mean(r['real_handoff_ms'] for r in g):>14.0f} {mean(r['handoff_ms'] for r in g):>6.0f}"
              f" {mean(r['real_client_ms'] for r in g):>12.0f}")


def table(rows: list[dict], key, label: str) -> None:
    groups = grouped(rows, key)
    print(f"\n{label:<28} {'n':>5} {'real ms':>9} {'sim ms':>9} {'gap ms':>8} {'gap %':>7}"
          f" {'queue':>7} {'prefill':>8} {'hand-off':>9}")
    for k in sorted(groups, key=str):
        g = groups[k]
        real, sim = mean(r["real_ms"] for r in g), mean(r["sim_ms"] for r in g)
        print(f"{k!s:<28} {len(g):>5} {real:>9.0f} {sim:>9.0f} {sim - real:>8.0f} {100 * (sim / real - 1):>6.1f}%"
              f" {mean(r['queue_ms'] for r in g):>7.0f} {mean(r['prefill_ms'] for r in g):>8.0f}"
              f" {mean(r['handoff_ms'] for r in g):>9.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="bench routing results (default: the calibration's reference)")
    parser.add_argument("--policy", default="kv-aware")
    parser.add_argument("--cold", type=int, default=24, help="requests counted as the cold opening")
    parser.add_argument("--calibration", default=str(CALIBRATION))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cal = json.loads(Path(args.calibration).read_text())
    files = args.files or [str(Path("benchmarks/results") / f.strip())
                           for f in cal["validation_reference"]["source"].split(":", 1)[1].split(",")]
    profile = load_profile("cpu", args.calibration).served()
    rows = []
    for seed, policies in sorted(real_runs(files).items()):
        if args.policy in policies:
            rows += rows_for(seed, policies[args.policy], profile, args.policy, args.cold)
    print(f"{args.policy}: {len(rows)} requests joined over seeds {sorted({r['seed'] for r in rows})}")
    table(rows, lambda r: "cold" if r["cold"] else "steady", "phase")
    steady = [r for r in rows if not r["cold"]]
    table(steady, lambda r: ("hit" if r["hit"] else "miss", r["worker"]), "steady: hit, worker")
    bins = (50, 200, 500, 1000)
    table(steady, lambda r: next((f"{i} queue < {b} ms" for i, b in enumerate(bins) if r["queue_ms"] < b),
                                 f"{len(bins)} queue >= {bins[-1]} ms"), "steady: sim queue")
    table(rows, lambda r: r["seed"], "seed")
    split_table(rows, lambda r: ("cold" if r["cold"] else "steady", "hit" if r["hit"] else "miss"), "split: phase, hit")
    gaps = [r["sim_ms"] - r["real_ms"] for r in steady]
    print(f"\nsteady gap per request: p10 {percentile(gaps, 10):.0f}, p50 {percentile(gaps, 50):.0f}, "
          f"p90 {percentile(gaps, 90):.0f} ms; real p50 {percentile([r['real_ms'] for r in steady], 50):.0f}, "
          f"sim p50 {percentile([r['sim_ms'] for r in steady], 50):.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(rows) + "\n")


if __name__ == "__main__":
    main()
