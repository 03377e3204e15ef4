"""``pdserve bench kvtier``: returning conversations on the real stack, recompute-only vs the KV spill tier
vs the spill tier with peer fetch across two prefill workers.

Workload (seeded): ``--sessions`` conversations, each opening with its own ``--history-tokens``
tokens of text (a document or a long history no other conversation shares), then ``--turns``
turns; each turn's prompt is the whole conversation so far plus ``--turn-tokens`` new user
tokens, and its ``--max-tokens`` greedy output joins the history. The turns go round robin over
the conversations (turn 1 of every conversation, then turn 2 of every one, ...), one request at
a time, so between two turns of a conversation every other conversation's history passes
through the prefill worker's KV pool: with ``--kv-cache-gb`` (the prefill worker's pool) several
times smaller than the conversations' total history, an LRU pool has evicted a conversation by
the time it returns.

Three stacks run side by side (services.launcher: embedded Redis, the router disaggregating every
request): ``recompute`` (1 prefill + 1 decode worker; today: an evicted prefix is computed again),
``spill`` (the same, the workers running ``--kv-spill-gb`` of spill tier, ``--kv-spill-dtype``) and
``peer`` (the spill stack with 2 prefill workers and the router's ``--peer-fetch``, routing
round-robin: with an odd number of conversations each turn lands on the prefill worker that did
not serve the conversation's previous turn, so the prefix lives on the other worker, and the one
that gets the turn pulls it over kvtransfer where the cost model says so). Each turn is sent to
every stack, rotating which goes first, so drift on a shared machine falls on all. Figures per mode: TTFT p50 / p99 of returning turns (turn 2 on) and of first turns,
prefix hit rate by tier (the prefill worker's ``pdserve_kv_tier_hits_total`` over its prompt
blocks), returning-turn requests per second (sequential: 1 / mean latency), and how many greedy
outputs are identical between the modes (int8 spill is lossy). The ratios:
``spill_ttft_ratio_vs_recompute`` = spill p50 / recompute p50 of returning turns (goal <= 0.3);
``peer_fetch_ttft_ratio_vs_recompute`` = peer p50 / recompute p50 (goal <= 0.4), with the peer
stack's fetches (ok / failed), bytes and seconds from its prefill workers' ``/metrics``.
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

MODES = ("recompute", "spill", "peer")
PREFILL_WORKERS = {"recompute": 1, "spill": 1, "peer": 2}
BLOCK_SIZE = 16


def _log(msg: str) -> None:
    print(f"[bench kvtier] {msg}", file=sys.stderr, flush=True)


def _spec(args, mode: str):
    from services.launcher import StackSpec

    spill = ["--kv-spill-gb", str(args.kv_spill_gb), "--kv-spill-dtype", args.kv_spill_dtype] if mode != "recompute" \
        else []
    router = ["--disaggregation", "always"]
    if mode == "peer":
        router += ["--policy", "round-robin", "--peer-fetch"]
    return StackSpec(prefill=PREFILL_WORKERS[mode], decode=1, model=args.model, dtype=args.dtype, threads=args.threads,
                     kv_cache_gb=args.decode_kv_cache_gb, prefill_kv_cache_gb=args.kv_cache_gb, gateway=False,
                     worker_args=spill, router_args=router)


def _tier_hits(stack, mode: str) -> dict[str, float]:
    """The prefill workers' tier hits, copy seconds and peer fetches, summed."""
    from services.planner.signals import scrape

    out = {"pool": 0.0, "spill": 0.0, "queries": 0.0, "restore_s": 0.0, "spill_s": 0.0, "fetch_ok": 0.0,
           "fetch_failed": 0.0, "fetch_bytes": 0.0, "fetch_s": 0.0}
    for i in range(PREFILL_WORKERS[mode]):
        for (name, labels), value in scrape(stack.procs[f"prefill-{i}"].metrics).items():
            lab = dict(labels)
            if name == "pdserve_kv_tier_hits_total":
                out[lab["tier"]] += value
            elif name == "pdserve_prefix_cache_queries_total":
                out["queries"] += value
            elif name == "pdserve_kv_tier_seconds_total":
                out[f"{lab['direction']}_s"] += value
            elif name == "pdserve_kv_peer_fetches_total":
                out[f"fetch_{lab['outcome']}"] += value
            elif name == "pdserve_kv_peer_fetch_bytes_total":
                out["fetch_bytes"] += value
            elif name == "pdserve_kv_peer_fetch_seconds_total":
                out["fetch_s"] += value
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
                k = (t * args.sessions + s) % len(MODES)
                order = MODES[k:] + MODES[:k]
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
        "peer_fetches": {"ok": int(hits["fetch_ok"]), "failed": int(hits["fetch_failed"])},
        "peer_fetch_bytes": int(hits["fetch_bytes"]), "peer_fetch_seconds": round(hits["fetch_s"], 3),
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
            _log(f"starting the {m} stack ({PREFILL_WORKERS[m]} prefill with a {args.kv_cache_gb} GB KV pool"
                 + (f" and a {args.kv_spill_gb} GB {args.kv_spill_dtype} spill tier" if m != "recompute" else "")
                 + ", 1 decode, router" + (" with --peer-fetch, round-robin" if m == "peer" else "") + ")")
            stack.start(args.ready_timeout_s)
        before = {m: _tier_hits(s, m) for m, s in stacks.items()}
        started = time.perf_counter()
        turns = asyncio.run(_conversations(stacks, args, tokenizer))
        wall = time.perf_counter() - started
        time.sleep(1.5)  # the workers' stats reach /metrics every second
        after = {m: _tier_hits(s, m) for m, s in stacks.items()}
    finally:
        for stack in stacks.values():
            stack.stop(15.0)
    modes = {m: _summary(turns[m], {k: after[m][k] - before[m][k] for k in after[m]}) for m in MODES}
    same = {m: sum(1 for a, b in zip(turns["recompute"], turns[m]) if a["output_ids"] == b["output_ids"])
            for m in ("spill", "peer")}
    base_p50 = modes["recompute"]["returning_ttft_ms_p50"]
    base_rps = modes["recompute"]["returning_requests_per_s"]
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
        "spill_ttft_ratio_vs_recompute": _ratio(modes["spill"]["returning_ttft_ms_p50"], base_p50),
        "spill_throughput_ratio_vs_recompute": _ratio(modes["spill"]["returning_requests_per_s"], base_rps),
        "peer_fetch_ttft_ratio_vs_recompute": _ratio(modes["peer"]["returning_ttft_ms_p50"], base_p50),
        "peer_fetch_throughput_ratio_vs_recompute": _ratio(modes["peer"]["returning_requests_per_s"], base_rps),
        "greedy_outputs_identical": {m: f"{n}/{len(turns[m])}" for m, n in same.items()},
        "goal_spill_ttft_ratio": 0.3, "goal_peer_fetch_ttft_ratio": 0.4,
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "turns": turns,
    }


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"{w['sessions']} conversations x {w['turns']} turns, histories from {w['history_tokens']} tokens; "
          f"prefill KV pool {w['prefill_kv_cache_gb']} GB, spill tier {w['kv_spill_gb']} GB {w['kv_spill_dtype']}")
    print(f"  {'mode':<10}{'TTFT p50':>10}{'p99':>10}{'1st turn':>10}{'hit pool':>10}{'hit spill':>10}{'req/s':>8}"
          f"{'fetches':>9}{'fetch MB':>10}")
    for m, s in result["modes"].items():
        tier = s["prefix_hit_rate_by_tier"]
        print(f"  {m:<10}{s['returning_ttft_ms_p50']:>10.1f}{s['returning_ttft_ms_p99']:>10.1f}"
              f"{s['first_turn_ttft_ms_p50']:>10.1f}{tier['pool'] or 0:>10.3f}{tier['spill'] or 0:>10.3f}"
              f"{s['returning_requests_per_s'] or 0:>8.3f}{s['peer_fetches']['ok']:>9}"
              f"{s['peer_fetch_bytes'] / 1e6:>10.1f}")
    print(f"spill_ttft_ratio_vs_recompute {result['spill_ttft_ratio_vs_recompute']} (goal <= "
          f"{result['goal_spill_ttft_ratio']}); throughput ratio {result['spill_throughput_ratio_vs_recompute']}")
    print(f"peer_fetch_ttft_ratio_vs_recompute {result['peer_fetch_ttft_ratio_vs_recompute']} (goal <= "
          f"{result['goal_peer_fetch_ttft_ratio']}); throughput ratio "
          f"{result['peer_fetch_throughput_ratio_vs_recompute']}; greedy outputs identical to recompute's "
          f"{result['greedy_outputs_identical']}")


def run(args) -> int:
    for name in ("sessions", "turns", "history_tokens", "turn_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.turns < 2:
        raise ValueError("--turns must be >= 2: the first turn of a conversation has nothing to return to")
    if args.sessions % 2 == 0:
        raise ValueError(f"--sessions must be odd (got {args.sessions}): the peer stack routes round-robin over 2 "
                         "prefill workers, and only with an odd count does each conversation's next turn land on "
                         "the worker that did not serve its last one")
    if args.kv_cache_gb <= 0 or args.kv_spill_gb <= 0:
        raise ValueError("--kv-cache-gb and --kv-spill-gb must be > 0")
    result = bench(args)
    result_files.report("kvtier", result, args, print_table)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kvtier", help="returning conversations on the real stack: recompute-only vs the KV "
                                      "spill tier vs spill + peer fetch across 2 prefill workers, TTFT of "
                                      "returning turns and hit rate by tier",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=7, help="conversations (odd: see the peer mode)")
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
