"""``pdserve bench soak --minutes M``: the stack at 70% of its measured capacity for a long time.

The stack is ``pdserve up``'s (services/launcher.py: embedded Redis, 1 prefill,
1 decode, router, gateway). A closed-loop probe measures capacity (completed
requests per second with 8 clients); then the shared load generator
(services/bench/load.py) sends Poisson arrivals at ``--load-share`` of it for
``--minutes``. Per window (``--window-s``): requests sent and completed,
throughput, p50/p99 TTFT, and every process's RSS and private memory (USS + swap:
RSS alone falls when a busy machine swaps). At the end: each process's private
memory slope (MiB per hour, least squares over the windows after the first, which
holds warm-up), outcomes, and the KV blocks still in use on every worker once idle
(leaks). Not in CI: it runs for as long as asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from services.bench import results as result_files


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None with fewer than two points."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return None if var == 0 else sum((t - mx) * (v - my) for t, v in points) / var * 3600


async def _soak(args, stack) -> dict:
    import psutil

    from services.bench.chaos import workload
    from services.bench.chaos_faults import wait_idle
    from services.bench.load import (
        COMPLETED,
        OpenAIClient,
        OpenAIRequest,
        closed_loop,
        open_loop,
    )
    from services.bench.stats import percentile

    host, port = stack.gateway_address.rsplit(":", 1)
    client = OpenAIClient(host, int(port), args.model_name, timeout_s=600)

    def items(n: int, seed: int) -> list[OpenAIRequest]:
        return [OpenAIRequest("chat", r.prompt, r.max_tokens, r.stream, r.priority) for r in workload(n, seed)]

    samples, wall = await closed_loop(client.send, items(args.capacity_requests, args.seed), clients=8)
    capacity = sum(s.ok for s in samples) / wall
    rate = capacity * args.load_share
    _log(f"capacity {capacity:.2f} requests/s; soaking at {rate:.2f}/s for {args.minutes:g} min")
    pids = {name: p.proc.pid for name, p in stack.procs.items()}
    if stack.server is not None:
        pids["redis"] = stack.server._process.pid
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    sent: list[tuple[float, object]] = []
    start = time.monotonic()

    async def send(item):
        at = time.monotonic() - start
        sample = await client.send(item)
        sent.append((at, sample))
        return sample

    rss: list[tuple[float, dict[str, float]]] = []  # resident set, as `ps` shows it
    private: list[tuple[float, dict[str, float]]] = []  # USS + swap: what the process owns, even swapped out

    def measure() -> None:
        now = time.monotonic() - start
        full = {n: p.memory_full_info() for n, p in procs.items()}
        rss.append((now, {n: round(m.rss / 2**20, 1) for n, m in full.items()}))
        private.append((now, {n: round((m.uss + m.swap) / 2**20, 1) for n, m in full.items()}))

    async def watch():
        while True:
            measure()
            await asyncio.sleep(args.window_s)

    watcher = asyncio.create_task(watch())
    n = max(1, round(rate * args.minutes * 60))
    await open_loop(send, items(n, args.seed + 1), rate=rate, seed=args.seed)
    watcher.cancel()
    measure()
    windows = []
    for w in range(int(max(at for at, _ in sent) // args.window_s) + 1):
        batch = [s for at, s in sent if w * args.window_s <= at < (w + 1) * args.window_s]
        ok = [s for s in batch if s.outcome == COMPLETED]
        windows.append({"t_s": w * args.window_s, "sent": len(batch), "completed": len(ok),
                        "output_tok_s": round(sum(s.tokens for s in ok) / args.window_s, 2),
                        "ttft_ms_p50": round(percentile([s.ttft for s in ok], 50) * 1e3, 1),
                        "ttft_ms_p99": round(percentile([s.ttft for s in ok], 99) * 1e3, 1)})
    # RSS alone falls when a busy machine swaps pages out; the slope is of USS + swap
    steady = [(t, r) for t, r in private if t >= args.window_s] or private
    leaked, idle_s = await wait_idle(stack, 90)
    all_samples = [s for _, s in sent]
    return {
        "capacity_req_s": round(capacity, 3), "rate_req_s": round(rate, 3), "minutes": args.minutes,
        "requests": len(all_samples), "completed": sum(s.outcome == COMPLETED for s in all_samples),
        "refused": sum(s.outcome == "refused" for s in all_samples),
        "other": sum(s.outcome == "other" for s in all_samples),
        "errors": sorted({s.error for s in all_samples if s.outcome == "other"})[:5],
        "ttft_ms_p50": round(percentile([s.ttft for s in all_samples if s.ok], 50) * 1e3, 1),
        "ttft_ms_p99": round(percentile([s.ttft for s in all_samples if s.ok], 99) * 1e3, 1),
        "rss_mib_start": rss[0][1], "rss_mib_end": rss[-1][1],
        "private_mib_start": private[0][1], "private_mib_end": private[-1][1],
        "private_mib_per_hour": {name: None if (v := slope_per_hour([(t, r[name]) for t, r in steady])) is None
                                 else round(v, 1) for name in procs},
        "leaked_blocks": sum(max(0, v) for v in leaked.values()), "blocks_in_use_when_idle": leaked,
        "idle_after_s": round(idle_s, 1), "windows": windows, "rss_mib": rss, "private_mib": private,
    }


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if args.minutes <= 0 or args.window_s <= 0 or not 0 < args.load_share <= 1:
        raise ValueError("--minutes and --window-s must be > 0, --load-share in (0, 1]")
    spec = StackSpec(prefill=1, decode=1, model=args.model, threads=args.threads, kv_cache_gb=args.kv_cache_gb)
    _log("starting the stack: embedded Redis, 1 prefill, 1 decode, router, gateway")
    with LocalStack(spec) as stack:
        import httpx

        args.model_name = httpx.get(f"http://{stack.gateway_address}/v1/models", timeout=30).json()["data"][0]["id"]
        result = asyncio.run(_soak(args, stack))
        result["log_trouble_lines"] = len(stack.trouble())
    result_files.save("soak", result, args)
    if args.json:
        print(json.dumps(result))
    else:
        for w in result["windows"]:
            print(f"t={w['t_s']:>6.0f}s sent {w['sent']:>4} completed {w['completed']:>4} "
                  f"{w['output_tok_s']:>7.1f} tok/s TTFT p50 {w['ttft_ms_p50']:.0f} p99 {w['ttft_ms_p99']:.0f} ms")
        print(f"USS + swap, MiB per hour: {result['private_mib_per_hour']}; leaked blocks {result['leaked_blocks']}; "
              f"completed {result['completed']}/{result['requests']}, other {result['other']}")
    return 0


def _log(msg: str) -> None:
    print(f"[bench soak] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="the stack at 70%% of measured capacity for --minutes: throughput, TTFT and "
                                    "every process's RSS over time, leaked blocks at the end",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load-share", type=float, default=0.7, help="sending rate as a share of measured capacity")
    p.add_argument("--window-s", type=float, default=60.0, help="seconds per reported window")
    p.add_argument("--capacity-requests", type=int, default=32, help="requests of the capacity probe")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per worker")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
