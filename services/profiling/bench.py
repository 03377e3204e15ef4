"""``pdserve bench profiling``: what profiling costs while it is off, against a build without it.

Two stacks run side by side (each: embedded Redis, 1 prefill + 1 decode worker,
router): the baseline from ``--baseline-code`` (a checkout of pdserve before
profiling existed; its processes import that tree's code) and this tree with
``--enable-profiling`` (the Admin service up, the engine steps wrapped in their
``record_function`` range, nothing recording). Load goes to one stack at a time:
blocks of a closed loop (``--clients`` concurrent greedy requests through the
router's gRPC API), in pairs ordered AB, BA, AB, ... so drift of a shared machine
falls on both alike. Each pair gives a ratio (profiling-off / baseline) of output
throughput and of p50 TTFT; the report is their mean and an interval of two
standard errors: "within noise" when the interval contains 1. Beside it, the probe
that says what to expect: the cost of the one per-step change (the ``phase`` range)
per call with no profiler running, next to a decode step's tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
from pathlib import Path

from services.bench import results as result_files
from services.bench.load import closed_loop
from services.bench.stats import ratio, summarize

PATHS = ("baseline", "profiling_off")


@contextlib.contextmanager
def _code_from(tree: Path | None):
    """Children started inside import their code from ``tree`` (cwd first on ``python -m``'s path)."""
    if tree is None:
        yield
        return
    cwd, old = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(tree)
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        os.chdir(cwd)
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


async def _blocks(args, addresses: dict[str, str]) -> list[dict]:
    import grpc

    from proto.pdserve.v1 import generate_pb2_grpc
    from services.gateway.bench import prompts, via_router

    channels = {p: grpc.aio.insecure_channel(a) for p, a in addresses.items()}
    stubs = {p: generate_pb2_grpc.GenerationStub(c) for p, c in channels.items()}
    rows = []
    try:
        block = 0
        for pair in range(args.pairs):
            order = PATHS if pair % 2 == 0 else PATHS[::-1]
            for path in order:
                # fresh prompts per block: no block is served from a prefix cache another filled
                items = prompts(args.seed * 1000 + block, args.requests, args.prompt_words)
                block += 1
                samples, wall = await closed_loop(lambda p, s=stubs[path]: via_router(s, p, args.max_tokens),
                                                  items, args.clients)
                row = {"pair": pair, "path": path, **summarize(samples, wall, 10.0, 1.0)}
                print(f"[bench profiling] pair {pair} {path:<13} {row['output_tok_s']:7.1f} tok/s  "
                      f"TTFT p50 {row['ttft_ms_p50']:7.1f} ms  failed {row['failed']}", file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        for c in channels.values():
            await c.close()
    return rows


def _interval(values: list[float]) -> dict:
    mean = statistics.fmean(values)
    half = 2 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return {"mean": round(mean, 4), "low": round(mean - half, 4), "high": round(mean + half, 4),
            "within_noise": bool(mean - half <= 1 <= mean + half), "pairs": [round(v, 4) for v in values]}


def phase_cost_us(calls: int = 20_000) -> dict:
    """The probe behind the ratio: what the one per-step change costs with no profiler running, per call
    (``profiler_range("engine.step")``: a ``record_function`` while the profiler records, NVTX on CUDA),
    against an empty ``with`` of a null context."""
    import time

    from services.phases import profiler_range, profiler_recording

    def timed(make) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            with make():
                pass
        return (time.perf_counter() - started) / calls * 1e6

    def requests_range():  # Engine.step's range naming its requests' trace ids: only a check while off
        return profiler_range("requests") if profiler_recording() else contextlib.nullcontext()

    timed(lambda: profiler_range("engine.step"))  # warm-up: the first call loads the profiler ops
    return {"phase_us": round(timed(lambda: profiler_range("engine.step")), 3),
            "requests_range_us": round(timed(requests_range), 3),
            "null_context_us": round(timed(contextlib.nullcontext), 3), "calls": calls}


def report(rows: list[dict]) -> dict:
    by_pair: dict[int, dict] = {}
    for row in rows:
        by_pair.setdefault(row["pair"], {})[row["path"]] = row
    tput = [ratio(p["profiling_off"]["output_tok_s"], p["baseline"]["output_tok_s"], 4) for p in by_pair.values()]
    ttft = [ratio(p["profiling_off"]["ttft_ms_p50"], p["baseline"]["ttft_ms_p50"], 4) for p in by_pair.values()]
    return {"throughput_ratio": _interval([v for v in tput if v is not None]),
            "ttft_p50_ratio": _interval([v for v in ttft if v is not None]), "blocks": rows}


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if not args.baseline_code:
        raise ValueError("--baseline-code DIR is required: a pdserve checkout without profiling to compare against, "
                         "e.g. `git archive <commit> | tar -x -C DIR`")
    baseline = Path(args.baseline_code).resolve()
    if not (baseline / "services" / "cli.py").is_file():
        raise ValueError(f"--baseline-code {args.baseline_code} is not a pdserve checkout (no services/cli.py)")
    if args.pairs < 2 or args.requests < 1 or args.clients < 1:
        raise ValueError("pairs must be >= 2, requests and clients >= 1")
    common = dict(prefill=1, decode=1, model=args.model, dtype=args.dtype, threads=args.threads,
                  transport=args.transport, kv_cache_gb=args.kv_cache_gb, gateway=False)
    print("[bench profiling] starting the baseline stack and the profiling-off stack", file=sys.stderr, flush=True)
    with contextlib.ExitStack() as stacks:
        with _code_from(baseline):
            base = stacks.enter_context(LocalStack(StackSpec(**common)))
        off = stacks.enter_context(LocalStack(StackSpec(**common, profiling=True)))
        rows = asyncio.run(_blocks(args, {"baseline": base.router_address, "profiling_off": off.router_address}))
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "save")},
              "per_step_cost": phase_cost_us(), **report(rows)}
    result_files.report("profiling", result, args, print_table)
    return 0


def print_table(result: dict) -> None:
    cost = result["per_step_cost"]
    print(f"per engine step, profiler off: phase() {cost['phase_us']:.2f} us, the requests' trace-id range "
          f"{cost['requests_range_us']:.2f} us (an empty with: {cost['null_context_us']:.2f} us)")
    for key in ("throughput_ratio", "ttft_p50_ratio"):
        r = result[key]
        print(f"{key:<17} profiling-off / baseline = {r['mean']:.3f}  [{r['low']:.3f}, {r['high']:.3f}]  "
              f"{'within noise' if r['within_noise'] else 'OUTSIDE noise'}  pairs {r['pairs']}")


def add_parser(sub) -> None:
    p = sub.add_parser("profiling", help="profiling compiled in but off vs a build without it (paired blocks)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-code", default=None, metavar="DIR",
                   help="(required) a pdserve checkout without profiling, e.g. `git archive <commit> | tar -x -C DIR`")
    p.add_argument("--pairs", type=int, default=6, help="block pairs (order alternates AB, BA)")
    p.add_argument("--requests", type=int, default=16, help="requests per block")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (closed loop)")
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--transport", default="tcp", choices=["ucx", "tcp"])
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
