"""``pdserve bench chaos``: faults injected into the real stack under load, and what the clients got back.

The stack is the one ``pdserve up`` starts (services/launcher.py) with the
embedded Redis-compatible server persisting to an append-only file, 2 prefill and
2 decode workers, the router and the gateway, supervised as ``pdserve up`` does
(a killed process is started again). Clients use the official ``openai`` client
(chaos_client.py): streaming and not, mixed priority tiers, prompts sharing a few
long prefixes. Each scenario sends its requests in an open loop at half the
stack's measured capacity and injects one fault while they run (chaos_faults.py);
then it waits until every process is back and idle and reads the KV blocks still
in use on every worker. It counts, per scenario and in total: requests sent,
completed, errored (a documented error reached the client), lost (anything else),
duplicate tokens and token gaps (from the SSE ids and per-token logprobs the
clients received, across Last-Event-ID resumes), leaked blocks, 5xx answers to
malformed requests, and the time from the fault to the first request sent after it
that completed. Goals: lost, duplicates, gaps, leaks and bad-input 5xx all zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time

from services.bench import results as result_files

# The clients (openai, httpx) and the faults (grpc) are imported when the bench runs: every pdserve
# process starts through services.cli, which builds this parser.

SCENARIOS = ["decode-kill", "prefill-kill", "router-kill", "redis-restart", "worker-stall", "overload",
             "client-disconnect", "bad-input", "transfer-fault"]
TIERS = ["interactive", "standard", "batch"]
COUNTS = ["requests_sent", "requests_completed", "requests_errored", "requests_lost", "requests_abandoned",
          "duplicate_tokens", "token_gaps", "leaked_blocks", "bad_input_5xx"]
GOALS = ["requests_lost", "duplicate_tokens", "token_gaps", "leaked_blocks", "bad_input_5xx"]
_PREFIXES = [" ".join(f"Rule {i}.{k}: {word} items go in box {k % 7}." for k in range(12))
             for i, word in enumerate(["red", "green", "blue", "yellow"])]


def workload(n: int, seed: int, disconnect_share: float = 0.0) -> list:
    """Chat requests (ChaosRequest): 2/3 streaming, mixed tiers, most sharing one of four long prefixes."""
    from services.bench.chaos_client import ChaosRequest

    rng = random.Random(seed)
    items, hung_up, streams = [], 0, 0
    for i in range(n):
        prefix = rng.choice(_PREFIXES) + " " if rng.random() < 0.75 else ""
        stream = i % 3 != 2
        item = ChaosRequest(f"{prefix}Question {seed}-{i}: where do the {rng.choice(['red', 'blue'])} items go?",
                            max_tokens=rng.randint(8, 32), stream=stream, priority=rng.choice(TIERS))
        streams += stream
        if stream and hung_up < streams * disconnect_share:  # every third stream hangs up; every other one resumes
            item.hang_up_after, item.resume = rng.randint(1, 3), hung_up % 2 == 0
            hung_up += 1
        items.append(item)
    return items


def tally(outcomes, ctx, leaked: dict[str, int], idle_s: float, wall_s: float) -> dict:
    from services.bench.chaos_client import ABANDONED, COMPLETED, ERRORED, LOST

    kinds = {k: sum(o.kind == k for o in outcomes) for k in (COMPLETED, ERRORED, LOST, ABANDONED)}
    bad_lost = sum(1 for _, status in ctx.bad_input if status == 0 or status >= 500)
    bad_errored = len(ctx.bad_input) - bad_lost
    after = [o.done_at for o in outcomes if o.kind == COMPLETED and ctx.fault_at and o.sent_at >= ctx.fault_at]
    return {
        "requests_sent": len(outcomes) + len(ctx.bad_input),
        "requests_completed": kinds[COMPLETED], "requests_errored": kinds[ERRORED] + bad_errored,
        "requests_lost": kinds[LOST] + bad_lost, "requests_abandoned": kinds[ABANDONED],
        "duplicate_tokens": sum(o.duplicate_tokens for o in outcomes),
        "token_gaps": sum(o.token_gaps for o in outcomes),
        "leaked_blocks": sum(max(0, v) for v in leaked.values()), "blocks_in_use_when_idle": leaked,
        "idle_after_s": round(idle_s, 1), "bad_input_5xx": ctx.bad_input_5xx,
        "recovery_s": round(min(after) - ctx.fault_at, 2) if after else None,
        "resumed_streams": sum(o.resumed for o in outcomes), "wall_s": round(wall_s, 1),
        "bad_input_requests": len(ctx.bad_input),
        "lost_detail": sorted({o.detail for o in outcomes if o.kind == LOST})[:5],
        "errored_detail": sorted({o.detail for o in outcomes if o.kind == ERRORED})[:5],
        "bad_input_statuses": sorted({f"{case}: {status}" for case, status in ctx.bad_input}),
    }


async def _scenario(name: str, n: int, args, stack, client, capacity: float, seed: int) -> dict:
    from services.bench.chaos_faults import (
        FAULTS,
        FaultContext,
        arm_transfer_faults,
        wait_healthy,
        wait_idle,
    )
    from services.bench.load import open_loop

    if name == "transfer-fault":
        old = {n: stack.procs[n].proc.pid for n in arm_transfer_faults(stack, args.transfer_timeout)}
        _log(f"transfer-fault: restarting {', '.join(old)} with PDSERVE_KV_FAULTS set")
        deadline = time.monotonic() + args.recover_timeout
        while any(stack.procs[n].proc.pid == pid for n, pid in old.items()) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)  # draining, then started again by the supervisor
        await wait_healthy(stack, args.recover_timeout)
    rate = max(0.2, capacity * args.load_share)
    ctx = FaultContext(stack, client.base_url, client.model, load_s=n / rate, stall_s=args.stall_s)
    items = workload(n, seed, disconnect_share=1 / 3 if name == "client-disconnect" else 0.0)
    _log(f"{name}: {n} requests at {rate:.2f}/s" + (f" after {args.overload_s:g} s at "
                                                      f"{capacity * args.overload_factor:.1f}/s" if name == "overload" else ""))
    started = time.monotonic()
    fault = asyncio.create_task(FAULTS[name](ctx))
    outcomes = []
    if name == "overload":
        burst = workload(max(1, round(capacity * args.overload_factor * args.overload_s)), seed + 10_000)
        flood = asyncio.create_task(open_loop(client.send, burst, rate=capacity * args.overload_factor, seed=seed))
        await asyncio.sleep(args.overload_s)
        ctx.fault_at = time.monotonic()  # recovery: from the end of the flood
        outcomes, _ = await open_loop(client.send, items, rate=rate, seed=seed)
        outcomes += (await flood)[0]
    else:
        outcomes, _ = await open_loop(client.send, items, rate=rate, seed=seed)
    await fault
    await wait_healthy(stack, args.recover_timeout)
    leaked, idle_s = await wait_idle(stack, args.idle_timeout)
    result = tally(outcomes, ctx, leaked, idle_s, time.monotonic() - started)
    if name == "transfer-fault":  # the workers say each fault they inject (kvtransfer/faults.py)
        said = [line for p in stack.procs.values() for line in p.trouble]
        result["timeouts_injected"] = sum("fault injection: holding back" in line for line in said)
        result["corruptions_injected"] = sum("fault injection: corrupting" in line for line in said)
        result["corruptions_caught"] = sum("arrived corrupted" in line for n, p in stack.procs.items()
                                           if n.startswith("decode") for line in p.trouble)
        result["faults_injected"] = result["timeouts_injected"] + result["corruptions_injected"]
    _log(f"  {name}: " + ", ".join(f"{k.replace('requests_', '')} {result[k]}" for k in COUNTS)
         + f", recovery {result['recovery_s']} s" + (f"; lost: {result['lost_detail']}" if result["requests_lost"] else "")
         + (f"; errored: {result['errored_detail']}" if result["errored_detail"] else ""))
    return result


async def _bench(args, stack) -> dict:
    from services.bench.chaos_client import COMPLETED, ChaosClient
    from services.bench.chaos_faults import wait_idle
    from services.bench.load import closed_loop

    host_port = stack.gateway_address
    client = ChaosClient(f"http://{host_port}/v1", "", deadline_s=args.deadline)
    try:
        client.model = (await client.openai.models.list()).data[0].id
        probe = workload(args.capacity_requests, args.seed - 1)
        for item in probe:
            item.stream = True
        t0 = time.monotonic()
        done, wall = await closed_loop(client.send, probe, clients=8)
        capacity = sum(o.kind == COMPLETED for o in done) / wall
        _log(f"capacity: {capacity:.2f} requests/s ({len(probe)} requests, 8 clients, {time.monotonic() - t0:.0f} s)")
        await wait_idle(stack, args.idle_timeout)
        scenarios = {}
        per = max(1, args.requests // len(args.scenario))
        for i, name in enumerate(args.scenario):
            scenarios[name] = await _scenario(name, per, args, stack, client, capacity, args.seed + 100 * i)
    finally:
        await client.close()
    total = {k: sum(s[k] for s in scenarios.values()) for k in COUNTS}
    recoveries = [s["recovery_s"] for s in scenarios.values() if s["recovery_s"] is not None]
    total["recovery_s"] = max(recoveries) if recoveries else None
    return {**total, "goals_met": all(total[k] == 0 for k in GOALS), "capacity_req_s": round(capacity, 3),
            "scenarios": scenarios,
            "config": {k: getattr(args, k) for k in ("requests", "load_share", "overload_factor", "overload_s",
                                                     "stall_s", "deadline", "kv_cache_gb", "threads", "seed",
                                                     "transfer_timeout", "claim_idle_ms")}
            | {"stack": "embedded valkey (AOF everysec), 2 prefill, 2 decode, router (disaggregation always, "
                       f"transfer timeout {args.transfer_timeout:g} s, queue reclaim after {args.claim_idle_ms} ms), "
                       "gateway, supervised"}}


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec
    from services.supervisor import Supervisor

    unknown = [s for s in args.scenario or () if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    args.scenario = [s for s in SCENARIOS if s in args.scenario] if args.scenario else list(SCENARIOS)
    if not args.transfer_timeout > 0 or args.claim_idle_ms < 1:
        raise ValueError("--transfer-timeout must be > 0 and --claim-idle-ms >= 1")
    if args.requests < len(args.scenario):
        raise ValueError("--requests must be at least one per scenario")
    spec = StackSpec(prefill=2, decode=2, model=args.model, threads=args.threads, kv_cache_gb=args.kv_cache_gb,
                     transport=args.transport, redis_aof=True, policy="kv-aware",
                     # every request takes the prefill -> KV transfer -> decode path the faults aim at
                     # (auto prefills short prompts on an idle decode worker itself)
                     router_args=["--transfer-timeout", f"{args.transfer_timeout:g}", "--disaggregation", "always",
                                  "--claim-idle-ms", str(args.claim_idle_ms)],
                     gateway_args=["--max-queued-requests", str(args.max_queued)])
    _log("starting the stack: embedded Redis with AOF, 2 prefill, 2 decode, router, gateway")
    stack = LocalStack(spec)
    stack.start()
    stop = threading.Event()
    supervisor = Supervisor(stack, lambda line: _log(f"supervisor: {line}"), base_backoff_s=0.5, max_backoff_s=5)

    def supervise() -> None:
        while not stop.wait(0.25):
            supervisor.check()

    threading.Thread(target=supervise, daemon=True).start()
    try:
        result = asyncio.run(_bench(args, stack))
    finally:
        stop.set()
        trouble = stack.trouble()
        stack.stop()
    result["restarts"] = supervisor.restarts
    result["log_trouble_lines"] = len(trouble)
    result["log_trouble_sample"] = trouble[:10]
    result_files.save("chaos", result, args)
    print(json.dumps(result) if args.json else format_table(result))
    return 0 if result["goals_met"] else 1


def format_table(result: dict) -> str:
    cols = ["sent", "completed", "errored", "lost", "abandoned", "dup", "gaps", "leaked", "bad_5xx", "recovery_s"]
    keys = COUNTS + ["recovery_s"]
    rows = [("scenario", *cols)] + [(name, *(s[k] for k in keys)) for name, s in result["scenarios"].items()]
    rows.append(("total", *(result[k] for k in keys)))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols) + 1)]
    lines = ["  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.append(f"capacity {result['capacity_req_s']} req/s; restarts {result['restarts']}; goals "
                 f"(lost, dup, gaps, leaked, bad_5xx all 0): {'met' if result['goals_met'] else 'NOT met'}")
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(f"[bench chaos] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("chaos", help="inject faults (kills, Redis restart, stalls, overload, disconnects, bad input) "
                                     "under load and count lost requests, duplicate tokens, gaps and leaked blocks",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scenario", action="append", default=None, metavar="NAME",
                   help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    p.add_argument("--requests", type=int, default=540, help="requests in all, split evenly across the scenarios "
                                                              "(overload's flood and the malformed requests come on top)")
    p.add_argument("--load-share", type=float, default=0.5, help="sending rate as a share of measured capacity")
    p.add_argument("--capacity-requests", type=int, default=24, help="requests of the capacity probe")
    p.add_argument("--overload-factor", type=float, default=10.0, help="overload: this many times capacity")
    p.add_argument("--overload-s", type=float, default=30.0, help="overload: for this long")
    p.add_argument("--stall-s", type=float, default=15.0, help="worker-stall: SIGSTOP for this long")
    p.add_argument("--deadline", type=float, default=180.0, help="a client gives up (lost) after this long")
    p.add_argument("--max-queued", type=int, default=64, help="the gateway's --max-queued-requests (429 beyond)")
    p.add_argument("--recover-timeout", type=float, default=300.0, help="seconds for killed processes to be back")
    p.add_argument("--idle-timeout", type=float, default=90.0, help="seconds for every worker to free its blocks")
    p.add_argument("--transfer-timeout", type=float, default=20.0,
                   help="the router's --transfer-timeout; transfer-fault holds a finish back 1.5 times it")
    p.add_argument("--claim-idle-ms", type=int, default=30_000,
                   help="the router's --claim-idle-ms: a killed router's requests are reclaimed after this long")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV cache per worker")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--model", default=None)
    p.add_argument("--transport", default="ucx", choices=["ucx", "tcp"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
