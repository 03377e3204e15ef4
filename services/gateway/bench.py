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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

from services.bench import results as result_files
from services.bench.stats import percentile as pct

_WORDS = ("river stone light garden window paper engine market silver forest music winter harbor signal "
          "letter mountain yellow planet bridge candle orange theory coffee island rocket thunder velvet "
          "marble dragon pencil castle meadow falcon lantern puzzle canyon").split()


# Each path's requests in two blocks, gateway-direct-direct-gateway: the paths' blocks are as far
# from the start of the run on average, so a steady drift of the machine's speed cancels out;
# block b of both paths has the same arrival schedule.
_ORDER = (("gateway", 0), ("direct", 0), ("direct", 1), ("gateway", 1))


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between content chunks
    tokens: int = 0
    error: str = ""


class _Timing:
    """One request's clock: its start and the arrival of each chunk that carries text."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first = self.last = None
        self.gaps: list[float] = []

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def sample(self, tokens: int) -> Sample:
        end = time.perf_counter()
        return Sample(True, (self.first or end) - self.start, end - self.start, self.gaps, tokens)


def prompts(seed: int, n: int, words: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}. " + " ".join(rng.choice(_WORDS) for _ in range(words)) + "\nSummary:" for i in range(n)]


async def via_gateway(client, base: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    timing, tokens = _Timing(), 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as resp:
            if resp.status_code != 200:
                return Sample(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(False, error=event["error"].get("message", "error"))
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    timing.chunk()
    except Exception as exc:  # a dropped connection counts as a failed request
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    return timing.sample(tokens)


async def via_router(stub, prompt: str, max_tokens: int) -> Sample:
    from proto.pdserve.v1 import common_pb2, generate_pb2

    req = generate_pb2.GenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                        temperature=0))
    timing, tokens = _Timing(), 0
    try:
        async for msg in stub.Generate(req, timeout=600):
            if msg.HasField("chunk"):
                if msg.chunk.text:
                    timing.chunk()
            else:
                tokens = msg.finish.usage.completion_tokens
    except Exception as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    return timing.sample(tokens)


async def run_path(send, prompt_list: list[str], rate: float, seed: int) -> tuple[list[Sample], float]:
    """Poisson arrivals at ``rate`` requests/s; returns the samples and the wall time."""
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    at = 0.0
    for p in prompt_list:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(p)))
        at += rng.expovariate(rate)
    samples = await asyncio.gather(*tasks)
    return samples, time.perf_counter() - start


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


def summarize(samples: list[Sample], wall: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [s for s in samples if s.ok]
    gaps = [g for s in ok for g in s.gaps]
    good = [s for s in ok if s.ttft <= slo_ttft and (not s.gaps or pct(s.gaps, 50) <= slo_itl)]
    return {
        "requests": len(samples), "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if not s.ok})[:3],
        "ttft_ms_p50": pct([s.ttft for s in ok], 50) * 1e3, "ttft_ms_p99": pct([s.ttft for s in ok], 99) * 1e3,
        "itl_ms_p50": pct(gaps, 50) * 1e3, "itl_ms_p99": pct(gaps, 99) * 1e3,
        "e2e_ms_p50": pct([s.e2e for s in ok], 50) * 1e3, "e2e_ms_p99": pct([s.e2e for s in ok], 99) * 1e3,
        "output_tok_s": sum(s.tokens for s in ok) / wall, "goodput_req_s": len(good) / wall, "wall_s": wall,
    }


async def _bench(args, stack) -> dict:
    import grpc
    import httpx

    from proto.pdserve.v1 import generate_pb2_grpc

    base = f"http://{stack.gateway_address}"
    results = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(limits=limits) as client, \
            grpc.aio.insecure_channel(stack.router_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        # warm-up: both paths once, so connections and first-call costs are not measured
        await via_gateway(client, base, model, "Warm up.", 2)
        await via_router(stub, "Warm up.", 2)
        sequential = None
        if args.pairs:
            _log(f"{args.pairs} pairs of single requests, one path after the other")
            firsts = {"gateway": lambda p: via_gateway(client, base, model, p, 2),
                      "direct": lambda p: via_router(stub, p, 2)}
            sequential = await run_pairs(firsts, prompts(args.seed + 1000, 2 * args.pairs, args.prompt_words))
            _log(f"  gateway - direct TTFT, median of pairs: {sequential['ttft_overhead_ms_p50']:.1f} ms")
        sends = {"gateway": lambda p: via_gateway(client, base, model, p, args.max_tokens),
                 "direct": lambda p: via_router(stub, p, args.max_tokens)}
        blocks = [(args.requests + 1) // 2, args.requests // 2]  # requests per block of each path
        for i, rate in enumerate(args.rates):
            samples: dict[str, list[Sample]] = {"gateway": [], "direct": []}
            walls = {"gateway": 0.0, "direct": 0.0}
            for n, (path, block) in enumerate(_ORDER):
                if not blocks[block]:
                    continue
                plist = prompts(args.seed + 4 * i + n + 1, blocks[block], args.prompt_words)
                _log(f"rate {rate:g}/s: {blocks[block]} requests via {path} (block {n + 1} of 4)")
                got, wall = await run_path(sends[path], plist, rate, args.seed + 2 * i + block)
                samples[path] += got
                walls[path] += wall
            row = {"rate": rate}
            for path in ("gateway", "direct"):
                row[path] = summarize(samples[path], walls[path], args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
                _log(f"  {path}: {row[path]['output_tok_s']:.1f} tok/s, p50 TTFT {row[path]['ttft_ms_p50']:.1f} ms, "
                     f"{row[path]['failed']} failed")
            results.append(row)
    ratios = [r["gateway"]["output_tok_s"] / r["direct"]["output_tok_s"] for r in results
              if r["direct"]["output_tok_s"] > 0]
    lowest = min(results, key=lambda r: r["rate"])
    return {
        "throughput_ratio_vs_direct": sum(ratios) / len(ratios) if ratios else None,
        "ttft_overhead_ms_p50": lowest["gateway"]["ttft_ms_p50"] - lowest["direct"]["ttft_ms_p50"],
        "ttft_overhead_ms_p50_sequential": sequential["ttft_overhead_ms_p50"] if sequential else None,
        "sequential": sequential,
        "rates": results,
        "config": {"requests_per_rate_and_path": args.requests, "sequential_pairs": args.pairs,
                   "prompt_words": args.prompt_words,
                   "max_tokens": args.max_tokens, "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms,
                   "dtype": args.dtype, "threads_per_worker": args.threads, "seed": args.seed,
                   "order": "per rate: gateway, direct, direct, gateway blocks; paired blocks share arrivals"},
    }


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if not args.rates or min(args.rates) <= 0 or args.requests < 1 or args.max_tokens < 1 or args.pairs < 0:
        raise ValueError("rates, requests and max-tokens must be positive, pairs not negative")
    spec = StackSpec(prefill=1, decode=1, model=args.model, dtype=args.dtype, threads=args.threads,
                     transport=args.transport, gateway=True,
                     gateway_args=["--max-queued-requests", "100000", "--max-queued-tokens", "100000000"])
    _log("starting the stack (embedded Redis, 1 prefill, 1 decode, router, gateway)")
    with LocalStack(spec) as stack:
        result = asyncio.run(_bench(args, stack))
    result_files.report("serve", result, args, print_table)
    return 0


def print_table(result: dict) -> None:
    print(f"{'rate':>5} {'path':>8} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16} {'E2E p50/p99 ms':>17} "
          f"{'tok/s':>7} {'goodput':>8} {'failed':>6}")
    for row in result["rates"]:
        for path in ("gateway", "direct"):
            r = row[path]
            print(f"{row['rate']:>5g} {path:>8} {r['ttft_ms_p50']:>8.1f}/{r['ttft_ms_p99']:<8.1f} "
                  f"{r['itl_ms_p50']:>7.1f}/{r['itl_ms_p99']:<8.1f} {r['e2e_ms_p50']:>8.1f}/{r['e2e_ms_p99']:<8.1f} "
                  f"{r['output_tok_s']:>7.1f} {r['goodput_req_s']:>8.2f} {r['failed']:>6}")
    ratio = result["throughput_ratio_vs_direct"]
    print(f"\nthroughput gateway/direct: {ratio:.3f}  (goal >= 0.90)" if ratio else "\nthroughput: no data")
    print(f"p50 TTFT overhead of gateway + queue: {result['ttft_overhead_ms_p50']:.1f} ms  (goal < 15 ms)")
    seq = result.get("sequential")
    if seq and seq["pairs"]:
        print(f"single requests one at a time ({seq['pairs']} pairs): gateway {seq['gateway_ttft_ms_p50']:.1f} ms, "
              f"direct {seq['direct_ttft_ms_p50']:.1f} ms p50 TTFT; gateway - direct, median of pairs "
              f"{seq['ttft_overhead_ms_p50']:.1f} ms (IQR {seq['ttft_overhead_ms_p25']:.1f} .. "
              f"{seq['ttft_overhead_ms_p75']:.1f})")


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="gateway + queue vs the router's gRPC API under Poisson load",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0],
                   help="arrival rates in requests/s, comma-separated")
    p.add_argument("--requests", type=int, default=40, help="requests per rate and path")
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
