"""``pdserve bench serve``: the gateway + queue path against the router's gRPC API, same workload, one run.

One stack (embedded Redis, 1 prefill + 1 decode worker, router, gateway). For
each arrival rate, the same kind of workload goes through both paths, Poisson
arrivals with a fixed seed: through the gateway (OpenAI ``/v1/completions``,
SSE, via the admission queue and the result streams) and straight to the
router's gRPC Generate. Each path's requests run in two blocks, in the order
gateway, direct, direct, gateway; the two blocks of a pair share one arrival
schedule. So both paths see the same arrivals, and a machine whose speed drifts
during the run (other jobs starting or ending) slows both alike instead of
whichever path happens to run while it is slow. The paths use different prompts
of the same shape, so neither is served from a prefix cache the other filled.
Per path and rate it prints TTFT, inter-token and end-to-end latency (p50,
p99), output throughput, and goodput (requests per second that met the SLO).
The ratios say what the gateway and queue cost: ``throughput_ratio_vs_direct``
(mean over rates of gateway / direct output tok/s) and ``ttft_overhead_ms_p50``
(gateway p50 TTFT minus direct p50 TTFT, at the lowest rate, where queueing in
the engine adds least noise).

Under Poisson load a request's TTFT depends on what it queues behind (one prefill
or three), which varies by hundreds of milliseconds, so the difference of two
p50s over 40 requests each moves by tens of milliseconds from run to run on its
own. Before the rates, ``--pairs`` pairs of single requests therefore go one at
a time, the two paths alternating; the median of the pairs' TTFT differences
(``ttft_overhead_ms_p50_sequential``) is the latency the gateway and queue add,
measured to a few milliseconds.

At one or two requests per second the throughput ratio is about 1 by
construction (both paths keep up). ``--mode closed`` therefore runs a closed
loop instead: N concurrent clients, each sending its next request as soon as its
last one is answered, for N = ``--clients`` rising until two levels in a row
raise neither path's output throughput by ``--saturation-gain``; it reports each
path's saturation throughput and their ratio
(``saturation_throughput_ratio_vs_direct``). Both modes use the shared load
generator (services/bench/load.py) for both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from services.bench import results as result_files
from services.bench.http_client import Connection
from services.bench.load import OpenAIClient, OpenAIRequest, Sample, closed_loop, open_loop
from services.bench.stats import percentile as pct
from services.bench.stats import ratio, summarize

_WORDS = ("river stone light garden window paper engine market silver forest music winter harbor signal "
          "letter mountain yellow planet bridge candle orange theory coffee island rocket thunder velvet "
          "marble dragon pencil castle meadow falcon lantern puzzle canyon").split()


# Each path's requests in two blocks, gateway-direct-direct-gateway: the paths' blocks are as far
# from the start of the run on average, so a steady drift of the machine's speed cancels out;
# block b of both paths has the same arrival schedule.
_ORDER = (("gateway", 0), ("direct", 0), ("direct", 1), ("gateway", 1))


def prompts(seed: int, n: int, words: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}. " + " ".join(rng.choice(_WORDS) for _ in range(words)) + "\nSummary:" for i in range(n)]


async def via_router(stub, prompt: str, max_tokens: int) -> Sample:
    from proto.pdserve.v1 import common_pb2, generate_pb2

    req = generate_pb2.GenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                        temperature=0))
    start = time.perf_counter()
    first = last = None
    gaps, tokens = [], 0
    try:
        async for msg in stub.Generate(req, timeout=600):
            if msg.HasField("chunk"):
                if msg.chunk.text:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            else:
                tokens = msg.finish.usage.completion_tokens
    except Exception as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return Sample(True, (first or end) - start, end - start, gaps, tokens)


async def run_pairs(sends, prompt_list: list[str]) -> dict:
    """Single requests, one at a time, alternating paths (G D, D G, ...): each pair's TTFT difference.

    Nothing else runs, so a request's TTFT is the hops plus its own prefill, and the
    difference within a pair (two requests of the same shape, a moment apart) is what
    the gateway and queue add, without the queueing noise of the Poisson runs.
    """
    diffs, ttft = [], {"gateway": [], "direct": []}
    for k in range(len(prompt_list) // 2):
        got = {}
        for j, path in enumerate(("gateway", "direct") if k % 2 == 0 else ("direct", "gateway")):
            got[path] = await sends[path](prompt_list[2 * k + j])
            await asyncio.sleep(0.05)  # the previous request's final event and ack are done
        if got["gateway"].ok and got["direct"].ok:
            diffs.append((got["gateway"].ttft - got["direct"].ttft) * 1e3)
            for path, sample in got.items():
                ttft[path].append(sample.ttft * 1e3)
    return {"pairs": len(diffs), "ttft_overhead_ms_p50": pct(diffs, 50),
            "ttft_overhead_ms_p25": pct(diffs, 25), "ttft_overhead_ms_p75": pct(diffs, 75),
            "gateway_ttft_ms_p50": pct(ttft["gateway"], 50), "direct_ttft_ms_p50": pct(ttft["direct"], 50)}


async def _bench(args, stack) -> dict:
    import grpc

    from proto.pdserve.v1 import generate_pb2_grpc

    host, port = stack.gateway_address.rsplit(":", 1)
    async with grpc.aio.insecure_channel(stack.router_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        probe = await Connection(host, int(port)).request("GET", "/v1/models")
        model = json.loads(probe.body)["data"][0]["id"]
        gateway = OpenAIClient(host, int(port), model)

        def sends(max_tokens: int) -> dict:
            return {"gateway": lambda p: gateway.send(OpenAIRequest("completion", p, max_tokens, stream=True)),
                    "direct": lambda p: via_router(stub, p, max_tokens)}

        # warm-up: both paths once, so connections and first-call costs are not measured
        for send in sends(2).values():
            await send("Warm up.")
        sequential = None
        if args.pairs:
            _log(f"{args.pairs} pairs of single requests, one path after the other")
            sequential = await run_pairs(sends(2), prompts(args.seed + 1000, 2 * args.pairs, args.prompt_words))
            _log(f"  gateway - direct TTFT, median of pairs: {sequential['ttft_overhead_ms_p50']:.1f} ms")
        if args.mode == "open":
            rows = await _open_rates(args, sends(args.max_tokens))
        else:
            rows = await _closed_levels(args, sends(args.max_tokens))
    return _report(args, rows, sequential)


async def _paired_blocks(args, send_by_path: dict, level: int, run_block, requests: int | None = None) -> dict:
    """One level (a rate, or a number of clients): each path's requests in blocks G D D G, summarized."""
    requests = requests or args.requests
    blocks = [(requests + 1) // 2, requests // 2]  # requests per block of each path
    samples: dict[str, list] = {"gateway": [], "direct": []}
    walls = {"gateway": 0.0, "direct": 0.0}
    for n, (path, block) in enumerate(_ORDER):
        if not blocks[block]:
            continue
        plist = prompts(args.seed + 4 * level + n + 1, blocks[block], args.prompt_words)
        got, wall = await run_block(send_by_path[path], plist, block)
        samples[path] += got
        walls[path] += wall
    return {path: summarize(samples[path], walls[path], args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
            for path in ("gateway", "direct")}


async def _open_rates(args, send_by_path: dict) -> list[dict]:
    rows = []
    for i, rate in enumerate(args.rates):
        _log(f"rate {rate:g}/s: {args.requests} requests per path (blocks gateway, direct, direct, gateway)")
        row = {"rate": rate, **await _paired_blocks(
            args, send_by_path, i, lambda send, plist, block: open_loop(send, plist, rate, args.seed + 2 * i + block))}
        _log_row(row)
        rows.append(row)
    return rows


async def _closed_levels(args, send_by_path: dict) -> list[dict]:
    """Closed loop at rising numbers of clients, until neither path's throughput rises by --saturation-gain."""
    rows, best, flat = [], {"gateway": 0.0, "direct": 0.0}, 0
    for i, clients in enumerate(args.clients):
        # every block has at least one request per client, or fewer clients than asked would run
        requests = max(args.requests, 2 * clients)
        _log(f"{clients} concurrent clients: {requests} requests per path (blocks G, D, D, G)")
        row = {"clients": clients, "requests_per_path": requests, **await _paired_blocks(
            args, send_by_path, i, lambda send, plist, _block: closed_loop(send, plist, clients), requests)}
        _log_row(row)
        rows.append(row)
        rising = [path for path in best if row[path]["output_tok_s"] > best[path] * (1 + args.saturation_gain)]
        for path in best:
            best[path] = max(best[path], row[path]["output_tok_s"])
        flat = 0 if rising else flat + 1
        if flat >= 2:  # two levels in a row without a rise: saturated
            _log(f"throughput stopped rising at {rows[-3]['clients']} clients")
            break
    return rows


def _report(args, rows: list[dict], sequential: dict | None) -> dict:
    ratios = [r["gateway"]["output_tok_s"] / r["direct"]["output_tok_s"] for r in rows
              if r["direct"]["output_tok_s"] > 0]
    config = {"mode": args.mode, "requests_per_level_and_path": args.requests, "sequential_pairs": args.pairs,
              "prompt_words": args.prompt_words, "max_tokens": args.max_tokens, "slo_ttft_ms": args.slo_ttft_ms,
              "slo_itl_ms": args.slo_itl_ms, "dtype": args.dtype, "threads_per_worker": args.threads,
              "seed": args.seed, "order": "per level: gateway, direct, direct, gateway blocks; paired blocks share "
                                          "arrivals (open loop) or clients (closed loop)"}
    result = {
        "throughput_ratio_vs_direct": sum(ratios) / len(ratios) if ratios else None,
        "ttft_overhead_ms_p50_sequential": sequential["ttft_overhead_ms_p50"] if sequential else None,
        "sequential": sequential, "config": config,
    }
    if args.mode == "open":
        lowest = min(rows, key=lambda r: r["rate"])
        result["ttft_overhead_ms_p50"] = lowest["gateway"]["ttft_ms_p50"] - lowest["direct"]["ttft_ms_p50"]
        result["rates"] = rows
    else:
        peak = {path: max(rows, key=lambda r: r[path]["output_tok_s"]) for path in ("gateway", "direct")}
        result.update({
            "levels": rows,
            "saturation_clients": {path: peak[path]["clients"] for path in peak},
            "saturation_output_tok_s": {path: peak[path][path]["output_tok_s"] for path in peak},
            "saturation_throughput_ratio_vs_direct": ratio(peak["gateway"]["gateway"]["output_tok_s"],
                                                           peak["direct"]["direct"]["output_tok_s"]),
        })
        config["clients"] = args.clients
        config["saturation_gain"] = args.saturation_gain
    return result


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if args.requests < 1 or args.max_tokens < 1 or args.pairs < 0:
        raise ValueError("requests and max-tokens must be positive, pairs not negative")
    if args.mode == "open" and (not args.rates or min(args.rates) <= 0):
        raise ValueError("rates must be positive")
    if args.mode == "closed" and (not args.clients or min(args.clients) < 1):
        raise ValueError("clients must be positive")
    spec = StackSpec(prefill=1, decode=1, model=args.model, dtype=args.dtype, threads=args.threads,
                     transport=args.transport, gateway=True,
                     gateway_args=["--max-queued-requests", "100000", "--max-queued-tokens", "100000000"])
    _log("starting the stack (embedded Redis, 1 prefill, 1 decode, router, gateway)")
    with LocalStack(spec) as stack:
        result = asyncio.run(_bench(args, stack))
    result_files.report("serve", result, args, print_table)
    return 0


def print_table(result: dict) -> None:
    closed = result["config"]["mode"] == "closed"
    key = "clients" if closed else "rate"
    print(f"{key:>7} {'path':>8} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16} {'E2E p50/p99 ms':>17} "
          f"{'tok/s':>7} {'goodput':>8} {'failed':>6}")
    for row in result["levels" if closed else "rates"]:
        for path in ("gateway", "direct"):
            r = row[path]
            print(f"{row[key]:>7g} {path:>8} {r['ttft_ms_p50']:>8.1f}/{r['ttft_ms_p99']:<8.1f} "
                  f"{r['itl_ms_p50']:>7.1f}/{r['itl_ms_p99']:<8.1f} {r['e2e_ms_p50']:>8.1f}/{r['e2e_ms_p99']:<8.1f} "
                  f"{r['output_tok_s']:>7.1f} {r['goodput_req_s']:>8.2f} {r['failed']:>6}")
    ratio_ = result["throughput_ratio_vs_direct"]
    print(f"\nthroughput gateway/direct (mean over levels): {ratio_:.3f}  (goal >= 0.90)" if ratio_
          else "\nthroughput: no data")
    if closed:
        sat, tok = result["saturation_clients"], result["saturation_output_tok_s"]
        print(f"saturation: gateway {tok['gateway']:.1f} tok/s at {sat['gateway']} clients, direct "
              f"{tok['direct']:.1f} tok/s at {sat['direct']} clients; ratio "
              f"{result['saturation_throughput_ratio_vs_direct']}")
    else:
        print(f"p50 TTFT overhead of gateway + queue: {result['ttft_overhead_ms_p50']:.1f} ms  (goal < 15 ms)")
    seq = result.get("sequential")
    if seq and seq["pairs"]:
        print(f"single requests one at a time ({seq['pairs']} pairs): gateway {seq['gateway_ttft_ms_p50']:.1f} ms, "
              f"direct {seq['direct_ttft_ms_p50']:.1f} ms p50 TTFT; gateway - direct, median of pairs "
              f"{seq['ttft_overhead_ms_p50']:.1f} ms (IQR {seq['ttft_overhead_ms_p25']:.1f} .. "
              f"{seq['ttft_overhead_ms_p75']:.1f})")


def _log_row(row: dict) -> None:
    for path in ("gateway", "direct"):
        r = row[path]
        _log(f"  {path}: {r['output_tok_s']:.1f} tok/s, p50 TTFT {r['ttft_ms_p50']:.1f} ms, {r['failed']} failed")


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="gateway + queue vs the router's gRPC API, open loop (Poisson) or closed loop",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=["open", "closed"], default="open",
                   help="open: Poisson arrivals at --rates; closed: --clients concurrent clients, each sending "
                        "its next request when the last is answered, rising until throughput stops rising")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0],
                   help="open loop: arrival rates in requests/s, comma-separated")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 128],
                   help="closed loop: numbers of concurrent clients, rising, comma-separated")
    p.add_argument("--saturation-gain", type=float, default=0.05,
                   help="closed loop: stop after two levels that raise neither path's throughput by this fraction")
    p.add_argument("--requests", type=int, default=40,
                   help="requests per level (rate or clients) and path; closed loop: at least twice the clients")
    p.add_argument("--pairs", type=int, default=30,
                   help="first, this many pairs of single requests (one per path, one at a time; 0: skip)")
    p.add_argument("--prompt-words", type=int, default=60, help="words per prompt (~1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT at most this")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput: median inter-token gap at most this")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--transport", default="ucx", choices=["ucx", "tcp"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
