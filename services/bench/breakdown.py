"""``pdserve bench breakdown``: where the wall time of a request and of an engine step goes, by phase.

The stack is ``pdserve up``'s (services/launcher.py: embedded Redis, 1 prefill,
1 decode, router, gateway). After a short warm-up, every process's ``/metrics`` is
read; the shared load generator (services/bench/load.py) sends a mixed workload
(the chaos bench's: chat requests, 2/3 streaming, mixed tiers, most sharing one of
four long prefixes, 8-32 output tokens) from ``--clients`` closed-loop clients; then
``/metrics`` is read again and the difference is the run's breakdown
(``services/phases.py`` names the phases):

* per request: the client's end-to-end wall time, against the gateway's phases
  (admission, queue wait, first chunk, streaming) summed over the same requests;
* per engine step, for each worker: the engine thread's loop time
  (``pdserve_engine_loop_seconds``) against its phases (forward by kind, schedule,
  sample, postprocess, publish, commands, idle); KV transfer waits are per request
  and shown apart (they overlap compute).

What the phases do not cover is printed as "unaccounted", never dropped; the goal
is phases >= 95% of the measured wall time on both sides. The cost of the timing
itself is measured here too (one ``phase`` enter/exit, in this process) and, times
the phases each worker recorded, given as a share of its loop time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.bench import results as result_files

GOAL_SHARE = 0.95
WORKER_ROLES = ("prefill", "decode")


def _sums(samples: dict, metric: str, role: str) -> dict[str, tuple[float, float]]:
    """phase -> (count, sum) of ``pdserve_phase_seconds{role}`` in one scrape (services.planner.signals.scrape)."""
    out: dict[str, list[float]] = {}
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if labels.get("role") != role or not name.startswith(metric):
            continue
        entry = out.setdefault(labels.get("phase", ""), [0.0, 0.0])
        if name == f"{metric}_count":
            entry[0] += value
        elif name == f"{metric}_sum":
            entry[1] += value
    return {k: (c, s) for k, (c, s) in out.items()}


def _delta(before: dict, after: dict, metric: str, role: str) -> dict[str, tuple[float, float]]:
    b, a = _sums(before, metric, role), _sums(after, metric, role)
    return {k: (c - b.get(k, (0, 0))[0], s - b.get(k, (0, 0))[1]) for k, (c, s) in a.items()}


def _table(wall_s: float, phase_s: dict[str, float], per: float) -> dict:
    """Each phase's seconds, share of ``wall_s`` and mean ms per ``per`` (request or step), plus the rest."""
    accounted = sum(phase_s.values())
    rows = {name: {"seconds": round(s, 4), "share": round(s / wall_s, 4) if wall_s else None,
                   "mean_ms": round(s / per * 1e3, 3) if per else None}
            for name, s in sorted(phase_s.items(), key=lambda kv: -kv[1])}
    rest = wall_s - accounted
    rows["unaccounted"] = {"seconds": round(rest, 4), "share": round(rest / wall_s, 4) if wall_s else None,
                           "mean_ms": round(rest / per * 1e3, 3) if per else None}
    return {"wall_s": round(wall_s, 4), "phases": rows,
            "accounted_share": round(accounted / wall_s, 4) if wall_s else None}


def phase_cost_us(n: int = 20000) -> float:
    """Microseconds one ``phase`` enter/exit costs on this machine (perf_counter pair + histogram observe)."""
    import time

    from services.phases import phase

    started = time.perf_counter()
    for _ in range(n):
        with phase("schedule", role="bench"):
            pass
    return (time.perf_counter() - started) / n * 1e6


def breakdown(before: dict[str, dict], after: dict[str, dict], samples: list, window_s: float,
              cost_us: float | None = None) -> dict:
    """The run's breakdown from the scrapes (process -> samples) around it and the client's samples."""
    from services import phases

    done = [s for s in samples if s.ok]
    client_wall = sum(s.e2e for s in done)
    gateway = _delta(before["gateway"], after["gateway"], "pdserve_phase_seconds", "gateway")
    wanted = phases.REQUEST_PHASES["gateway"]
    observed = {k: gateway.get(k, (0, 0)) for k in wanted}
    request = _table(client_wall, {k: s for k, (_, s) in observed.items()}, len(done))
    request.update(requests=len(done), failed=len(samples) - len(done),
                   phase_counts={k: int(c) for k, (c, _) in observed.items()})
    engines = {}
    for role in WORKER_ROLES:
        deltas = _delta(before[role], after[role], "pdserve_phase_seconds", role)
        loop_n, loop_s = _delta(before[role], after[role], "pdserve_engine_loop_seconds", role).get("", (0, 0))
        steps = deltas.get("schedule", (0, 0))[0]  # one schedule phase per Engine.step
        table = _table(loop_s, {k: s for k, (_, s) in deltas.items() if k in phases.STEP_PHASES}, steps)
        busy_s = loop_s - deltas.get("idle", (0, 0))[1]
        wait_n, wait_s = deltas.get("kv_transfer_wait", (0, 0))
        table.update(loop_iterations=int(loop_n), steps=int(steps), window_s=round(window_s, 3),
                     loop_share_of_window=round(loop_s / window_s, 4) if window_s else None,
                     busy_share_of_window=round(busy_s / window_s, 4) if window_s else None,
                     kv_transfer_wait={"requests": int(wait_n),
                                       "mean_ms": round(wait_s / wait_n * 1e3, 3) if wait_n else None})
        if cost_us is not None and loop_s:
            timed = sum(c for k, (c, _) in deltas.items() if k in phases.STEP_PHASES) + loop_n
            table["timing_overhead_share_est"] = round(timed * cost_us * 1e-6 / loop_s, 5)
        engines[role] = table
    shares = [request["accounted_share"]] + [t["accounted_share"] for t in engines.values()]
    return {"request": request, "engine": engines, "goal_accounted_share": GOAL_SHARE, "phase_cost_us": cost_us,
            "meets_goal": all(s is not None and s >= GOAL_SHARE for s in shares)}


async def _run(args, stack) -> dict:
    import time

    from services.bench.chaos import workload
    from services.bench.load import OpenAIClient, OpenAIRequest, closed_loop
    from services.planner.signals import scrape

    host, port = stack.gateway_address.rsplit(":", 1)
    client = OpenAIClient(host, int(port), args.model_name, timeout_s=600)
    items = [OpenAIRequest("chat", r.prompt, r.max_tokens, r.stream, r.priority)
             for r in workload(args.requests + args.warmup, args.seed)]
    if args.warmup:
        _log(f"warm-up: {args.warmup} requests")
        await closed_loop(client.send, items[:args.warmup], clients=1)
    addresses = {"gateway": stack.gateway_address, "prefill": stack.procs["prefill-0"].metrics,
                 "decode": stack.procs["decode-0"].metrics}
    loop = asyncio.get_running_loop()

    async def read_all() -> dict[str, dict]:
        return {k: await loop.run_in_executor(None, scrape, a) for k, a in addresses.items()}

    before = await read_all()
    _log(f"mixed workload: {args.requests} requests from {args.clients} clients")
    started = time.perf_counter()
    samples, wall = await closed_loop(client.send, items[args.warmup:], clients=args.clients)
    await asyncio.sleep(0.3)  # the idle engine loops finish the iteration they are in (a 50 ms wait)
    window = time.perf_counter() - started
    after = await read_all()
    result = breakdown(before, after, samples, window, phase_cost_us())
    result["workload"] = {"requests": args.requests, "clients": args.clients, "warmup": args.warmup,
                          "seed": args.seed, "wall_s": round(wall, 3),
                          "streamed": sum(1 for i in items[args.warmup:] if i.stream),
                          "output_tokens": sum(s.tokens for s in samples if s.ok)}
    return result


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if args.requests < 1 or args.clients < 1 or args.warmup < 0:
        raise ValueError("--requests and --clients must be >= 1, --warmup >= 0")
    spec = StackSpec(prefill=1, decode=1, model=args.model, dtype=args.dtype, threads=args.threads,
                     kv_cache_gb=args.kv_cache_gb)
    _log("starting the stack: embedded Redis, 1 prefill, 1 decode, router, gateway")
    with LocalStack(spec) as stack:
        import httpx

        args.model_name = httpx.get(f"http://{stack.gateway_address}/v1/models", timeout=30).json()["data"][0]["id"]
        result = asyncio.run(_run(args, stack))
    result_files.report("breakdown", result, args, print_table)
    return 0


def print_table(result: dict) -> None:
    req = result["request"]
    print(f"per request ({req['requests']} completed, client wall {req['wall_s']:.2f} s in all; "
          f"phases account for {req['accounted_share']:.1%}):")
    _rows(req["phases"], "ms/request")
    for role, table in result["engine"].items():
        wait = table["kv_transfer_wait"]
        print(f"\n{role} engine thread ({table['steps']} steps, {table['loop_iterations']} loop iterations, "
              f"loop {table['wall_s']:.2f} s of a {table['window_s']:.2f} s window; phases account for "
              f"{table['accounted_share']:.1%}):")
        _rows(table["phases"], "ms/step")
        if wait["requests"]:
            print(f"  (per request, overlapping the above: KV transfer wait {wait['mean_ms']:.1f} ms mean "
                  f"over {wait['requests']})")
        if table.get("timing_overhead_share_est") is not None:
            print(f"  (the timing itself: {result['phase_cost_us']:.1f} us per phase, ~"
                  f"{table['timing_overhead_share_est']:.3%} of this thread's time)")
    print(f"\ngoal: phases >= {result['goal_accounted_share']:.0%} of wall time: "
          f"{'met' if result['meets_goal'] else 'NOT met'}")


def _rows(rows: dict, per: str) -> None:
    print(f"  {'phase':<16}{'seconds':>10}{'share':>8}{per:>14}")
    for name, row in rows.items():
        share = "-" if row["share"] is None else f"{row['share']:.1%}"
        mean = "-" if row["mean_ms"] is None else f"{row['mean_ms']:.2f}"
        print(f"  {name:<16}{row['seconds']:>10.3f}{share:>8}{mean:>14}")


def _log(msg: str) -> None:
    print(f"[bench breakdown] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("breakdown", help="where a request's and an engine step's wall time goes, by phase, on the "
                                         "real stack under a mixed workload",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=48, help="requests of the measured workload")
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients (concurrency)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (one at a time) before measuring")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per worker")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--dtype", default="bf16", help="worker dtype")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
