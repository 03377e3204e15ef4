"""``pdserve bench kvtier``: returning conversations on the real stack, recompute-only vs the KV spill tier.

Workload (seeded): ``--sessions`` conversations, each opening with its own ``--history-tokens``
tokens of text (a document or a long history no other conversation shares), then ``--turns``
turns; each turn's prompt is the whole conversation so far plus ``--turn-tokens`` new user
tokens, and its ``--max-tokens`` greedy output joins the history. The turns go round robin over
the conversations (turn 1 of every conversation, then turn 2 of every one, ...), one request at
a time, so between two turns of a conversation every other conversation's history passes
through the prefill worker's KV pool: with ``--kv-cache-gb`` (the prefill worker's pool) several
times smaller than the conversations' total history, an LRU pool has evicted a conversation by
the time it returns.

Two stacks run side by side (services.launcher: embedded Redis, 1 prefill + 1 decode worker,
the router disaggregating every request): ``recompute`` (today: an evicted prefix is computed
again) and ``spill`` (the workers run ``--kv-spill-gb`` of spill tier, ``--kv-spill-dtype``).
Each turn is sent to both, alternating which goes first, so drift on a shared machine falls on
both. Figures per mode: TTFT p50 / p99 of returning turns (turn 2 on) and of first turns,
prefix hit rate by tier (the prefill worker's ``pdserve_kv_tier_hits_total`` over its prompt
blocks), returning-turn requests per second (sequential: 1 / mean latency), and how many greedy
outputs are identical between the modes (int8 spill is lossy). The ratios:
``spill_ttft_ratio_vs_recompute`` = spill p50 / recompute p50 of returning turns (goal <= 0.3).
``peer_fetch_ttft_ratio_vs_recompute`` is null: peer fetch is not built (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

from services.bench import results as result_files
from services.bench.stats import percentile
from services.router.bench import _generate, _text_tokens  # the routing bench's client and text (one harness)

MODES = ("recompute", "spill")
BLOCK_SIZE = 16


def _log(msg: str) -> None:
    print(f"[bench kvtier] {msg}", file=sys.stderr, flush=True)


def _spec(args, mode: str):
    from services.launcher import StackSpec

    spill = ["--kv-spill-gb", str(args.kv_spill_gb), "--kv-spill-dtype", args.kv_spill_dtype] if mode == "spill" else []
    return StackSpec(prefill=1, decode=1, model=args.model, dtype=args.dtype, threads=args.threads,
                     kv_cache_gb=args.decode_kv_cache_gb, prefill_kv_cache_gb=args.kv_cache_gb, gateway=False,
                     worker_args=spill, router_args=["--disaggregation", "always"])


def _tier_hits(address: str) -> dict[str, float]:
    from services.planner.signals import scrape

    samples = scrape(address)
    out = {"pool": 0.0, "spill": 0.0, "queries": 0.0, "restore_s": 0.0, "spill_s": 0.0}
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == "pdserve_kv_tier_hits_total":
            out[lab["tier"]] += value
        elif name == "pdserve_prefix_cache_queries_total":
            out["queries"] += value
        elif name == "pdserve_kv_tier_seconds_total":
            out[f"{lab['direction']}_s"] += value
    return out


async def _conversations(stacks: dict, args, tokenizer) -> dict[str, list[dict]]:
    import grpc

    from proto.pdserve.v1 import generate_pb2_grpc

    rng = random.Random(args.seed)
    histories = [_text_tokens(tokenizer, rng, f"Conversation {s}: a long shared document follows.", args.history_tokens)
                 for s in range(args.sessions)]
    turns: dict[str, list[dict]] = {m: [] for m in MODES}
    channels = {m: grpc.aio.insecure_channel(stack.router_address) for m, stack in stacks.items()}
    stubs = {m: generate_pb2_grpc.GenerationStub(c) for m, c in channels.items()}
    try:
        for t in range(args.turns):
            for s in range(args.sessions):
                prompt = histories[s] + _text_tokens(tokenizer, rng, f" User turn {t}:", args.turn_tokens)
                order = MODES if (t * args.sessions + s) % 2 == 0 else MODES[::-1]
                outputs = {}
                for m in order:
                    started = time.perf_counter()
                    r = await _generate(stubs[m], f"{m}-s{s}-t{t}", prompt, args.max_tokens, args.request_timeout_s)
                    latency = time.perf_counter() - started
                    if r.error:
                        raise RuntimeError(f"{m} turn {t} of conversation {s} failed: {r.error}")
                    outputs[m] = r.output_ids
                    turns[m].append({"session": s, "turn": t, "prompt_tokens": r.prompt_tokens,
                                     "cached_tokens": r.cached_tokens, "ttft_ms": round(r.ttft_s * 1e3, 2),
                                     "latency_s": round(latency, 4), "output_ids": r.output_ids})
                # the next turn continues the recompute stack's answer (the reference); a spill-mode
                # answer that differs is counted, and its next prompt is the same as recompute's
                histories[s] = prompt + outputs["recompute"]
            _log(f"turn {t + 1}/{args.turns} of {args.sessions} conversations done; history "
                 f"~{len(histories[0])} tokens each")
    finally:
        for c in channels.values():
            await c.close()
    return turns


def _summary(turns: list[dict], hits: dict[str, float]) -> dict:
    back = [t for t in turns if t["turn"] > 0]
    first = [t for t in turns if t["turn"] == 0]
    ttft = [t["ttft_ms"] for t in back]
    queries = hits["queries"]
    return {
        "returning_turns": len(back),
        "returning_ttft_ms_p50": round(percentile(ttft, 50), 1),
        "returning_ttft_ms_p99": round(percentile(ttft, 99), 1),
        "first_turn_ttft_ms_p50": round(percentile([t["ttft_ms"] for t in first], 50), 1),
        "returning_prompt_tokens_mean": round(sum(t["prompt_tokens"] for t in back) / max(1, len(back))),
        "returning_cached_share": round(sum(t["cached_tokens"] for t in back)
                                        / max(1, sum(t["prompt_tokens"] for t in back)), 4),
        "prefix_hit_rate_by_tier": {tier: round(hits[tier] / queries, 4) if queries else None
                                    for tier in ("pool", "spill")},
        "prefix_blocks_looked_up": int(queries),
        "restore_seconds": round(hits["restore_s"], 3), "spill_seconds": round(hits["spill_s"], 3),
        "returning_requests_per_s": round(len(back) / sum(t["latency_s"] for t in back), 3) if back else None,
    }


def bench(args) -> dict:
    from services.launcher import LocalStack
    from services.router.server import load_tokenizer

    load_start = os.getloadavg()
    tokenizer, model_name = load_tokenizer(args.model)
    if tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer; the kvtier bench builds its prompts from text")
    stacks = {m: LocalStack(_spec(args, m)) for m in MODES}
    try:
        for m, stack in stacks.items():
            _log(f"starting the {m} stack (1 prefill with a {args.kv_cache_gb} GB KV pool"
                 + (f" and a {args.kv_spill_gb} GB {args.kv_spill_dtype} spill tier" if m == "spill" else "")
                 + ", 1 decode, router)")
            stack.start(args.ready_timeout_s)
        before = {m: _tier_hits(s.procs["prefill-0"].metrics) for m, s in stacks.items()}
        started = time.perf_counter()
        turns = asyncio.run(_conversations(stacks, args, tokenizer))
        wall = time.perf_counter() - started
        time.sleep(1.5)  # the workers' stats reach /metrics every second
        after = {m: _tier_hits(s.procs["prefill-0"].metrics) for m, s in stacks.items()}
    finally:
        for stack in stacks.values():
            stack.stop(15.0)
    modes = {m: _summary(turns[m], {k: after[m][k] - before[m][k] for k in after[m]}) for m in MODES}
    pairs = list(zip(turns["recompute"], turns["spill"]))
    same = sum(1 for a, b in pairs if a["output_ids"] == b["output_ids"])
    spill_p50, base_p50 = modes["spill"]["returning_ttft_ms_p50"], modes["recompute"]["returning_ttft_ms_p50"]
    for m in MODES:
        for t in turns[m]:
            del t["output_ids"]
    return {
        "workload": {"sessions": args.sessions, "turns": args.turns, "history_tokens": args.history_tokens,
                     "turn_tokens": args.turn_tokens, "max_tokens": args.max_tokens, "seed": args.seed,
                     "prefill_kv_cache_gb": args.kv_cache_gb, "kv_spill_gb": args.kv_spill_gb,
                     "kv_spill_dtype": args.kv_spill_dtype, "threads": args.threads, "model": model_name,
                     "wall_s": round(wall, 1)},
        "modes": modes,
        "spill_ttft_ratio_vs_recompute": round(spill_p50 / base_p50, 3) if base_p50 else None,
        "spill_throughput_ratio_vs_recompute": round(modes["spill"]["returning_requests_per_s"]
                                                     / modes["recompute"]["returning_requests_per_s"], 3),
        "peer_fetch_ttft_ratio_vs_recompute": None,  # peer fetch is not built
        "greedy_outputs_identical": f"{same}/{len(pairs)}",
        "goal_spill_ttft_ratio": 0.3,
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "turns": turns,
    }


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"{w['sessions']} conversations x {w['turns']} turns, histories from {w['history_tokens']} tokens; "
          f"prefill KV pool {w['prefill_kv_cache_gb']} GB, spill tier {w['kv_spill_gb']} GB {w['kv_spill_dtype']}")
    print(f"  {'mode':<10}{'TTFT p50':>10}{'p99':>10}{'1st turn':>10}{'hit pool':>10}{'hit spill':>10}{'req/s':>8}")
    for m, s in result["modes"].items():
        tier = s["prefix_hit_rate_by_tier"]
        print(f"  {m:<10}{s['returning_ttft_ms_p50']:>10.1f}{s['returning_ttft_ms_p99']:>10.1f}"
              f"{s['first_turn_ttft_ms_p50']:>10.1f}{tier['pool'] or 0:>10.3f}{tier['spill'] or 0:>10.3f}"
              f"{s['returning_requests_per_s'] or 0:>8.3f}")
    print(f"spill_ttft_ratio_vs_recompute {result['spill_ttft_ratio_vs_recompute']} (goal <= "
          f"{result['goal_spill_ttft_ratio']}); throughput ratio {result['spill_throughput_ratio_vs_recompute']}; "
          f"greedy outputs identical {result['greedy_outputs_identical']}; peer fetch: not built")


def run(args) -> int:
    for name in ("sessions", "turns", "history_tokens", "turn_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.turns < 2:
        raise ValueError("--turns must be >= 2: the first turn of a conversation has nothing to return to")
    if args.kv_cache_gb <= 0 or args.kv_spill_gb <= 0:
        raise ValueError("--kv-cache-gb and --kv-spill-gb must be > 0")
    result = bench(args)
    result_files.report("kvtier", result, args, print_table)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kvtier", help="returning conversations on the real stack: recompute-only vs the KV "
                                      "spill tier, TTFT of returning turns and hit rate by tier",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=8, help="conversations")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (the first is cold)")
    p.add_argument("--history-tokens", type=int, default=2048, help="each conversation's opening history")
    p.add_argument("--turn-tokens", type=int, default=48, help="new user tokens per turn")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy output tokens per turn")
    p.add_argument("--kv-cache-gb", type=float, default=0.1,
                   help="the prefill worker's KV pool (small, so the conversations overflow it)")
    p.add_argument("--decode-kv-cache-gb", type=float, default=0.25, help="the decode worker's KV pool")
    p.add_argument("--kv-spill-gb", type=float, default=1.0, help="the spill tier of the spill stack's workers")
    p.add_argument("--kv-spill-dtype", default="int8", choices=["int8", "auto"], help="what the spill tier stores")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--dtype", default="bf16", help="worker dtype")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
