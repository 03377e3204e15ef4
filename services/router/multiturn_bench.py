"""``pdserve bench routing --workload multi-turn``: cached-token share of conversations with a session key against kv-aware routing alone.

Workload (seeded): ``--sessions`` conversations of ``--turns`` turns. A
conversation opens with its own ``--prefix-tokens`` tokens (a system prompt and
first message no other conversation shares); each turn adds ``--turn-tokens``
user tokens, and the next turn's prompt is the whole conversation so far: the
previous prompt, its ``--max-tokens`` output tokens (greedy, EOS ignored), and
the new user tokens. A turn is sent the moment the previous one finishes, so it
reaches the router before the KV events of the previous turn's cache do (they
are published as the worker's cache changes and read by the router in the
background). ``--concurrency`` conversations are in flight at once.

The stack (services.launcher): ``--decode`` decode workers (default 2) and
``--prefill`` prefill workers (default 0 here: each decode worker prefills its
own prompts, so the decode worker's cache is where a conversation's history
is), the router with the kv-aware policy. Without a key the router picks the
decode worker by load (the fewest requests, then the most free blocks); with a
key (``GenerateRequest.session_key``, what ``prompt_cache_key`` and
``X-Session-ID`` become) the key's worker (services/router/affinity.py).

Arms, on one stack: ``key`` (every request carries its conversation's id) and
``no-key`` (kv-aware routing alone), each with fresh conversations that share
no block with any other. ``--rounds`` rounds, the arms alternating which goes
first, so drift on a shared machine falls on both. Figures per arm, from each
Finish: cached-token share (cached / prompt tokens) over every turn and over the
turns after the first, the best possible share (every full block of the
previous turn's prompt and output cached), TTFT, how often a conversation's next
turn went to another decode worker, and requests per decode worker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import asdict, dataclass

from services.bench.stats import percentile
from services.router.bench import (
    Result,
    RoutingBenchConfig,
    Stack,
    StackError,
    _generate,
    _log,
    _ratio,
    _text_tokens,
    run_requests,
)

ARMS = ("key", "no-key")
BLOCK_SIZE = 16  # the workers' default (EngineConfig.block_size)


@dataclass
class MultiTurnConfig:
    sessions: int = 8
    turns: int = 4
    turn_tokens: int = 32
    rounds: int = 2
    decode: int = 2

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "turn_tokens", "rounds", "decode"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.turns < 2:
            raise ValueError("--turns must be >= 2: the first turn of a conversation has no history to find")


@dataclass
class Turn:
    session: int
    turn: int
    prompt_tokens: int
    best_cached: int  # full blocks of the previous turn's prompt + output (0 on the first turn)
    result: Result


async def run_arm(address: str, tokenizer, cfg: RoutingBenchConfig, mt: MultiTurnConfig, arm: str,
                  round_no: int) -> tuple[list[Turn], float]:
    """One arm: every conversation, ``cfg.concurrency`` at a time, each turn sent when the last one ends."""
    import grpc

    from proto.pdserve.v1 import generate_pb2_grpc

    rng = random.Random(f"{cfg.seed}-{round_no}-{arm}")
    turns: list[Turn] = []
    pending = iter(range(mt.sessions))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def conversation(s: int) -> None:
            tag = f"{arm}-r{round_no}-s{s}"
            key = f"conversation-{tag}" if arm == "key" else ""
            history = _text_tokens(tokenizer, rng, f"Conversation {tag}: you are assistant {s}.", cfg.prefix_tokens)
            best = 0
            for t in range(mt.turns):
                prompt = history + _text_tokens(tokenizer, rng, f" User turn {t}:", mt.turn_tokens)
                r = await _generate(stub, f"{tag}-t{t}", prompt, cfg.max_tokens, cfg.request_timeout_s, key)
                turns.append(Turn(s, t, len(prompt), min(best, len(prompt) - 1), r))
                if r.error:
                    return  # the rest of this conversation would not be the conversation
                history = prompt + r.output_ids
                # the last output token's KV is never computed (it is not fed back): blocks before it
                best = (len(history) - 1) // BLOCK_SIZE * BLOCK_SIZE

        async def client() -> None:
            for s in pending:  # shared iterator: each conversation runs exactly once
                await conversation(s)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(cfg.concurrency, mt.sessions))))
        return turns, time.perf_counter() - start


def summarize_arm(turns: list[Turn], wall_s: float, names: dict[str, str]) -> dict:
    ok = [t for t in turns if not t.result.error]
    later = [t for t in ok if t.turn > 0]

    def share(ts: list[Turn]) -> float | None:
        prompt = sum(t.result.prompt_tokens for t in ts)
        return round(sum(t.result.cached_tokens for t in ts) / prompt, 4) if prompt else None

    def best(ts: list[Turn]) -> float | None:
        prompt = sum(t.result.prompt_tokens for t in ts)
        return round(sum(t.best_cached for t in ts) / prompt, 4) if prompt else None

    by_session: dict[tuple, list[Turn]] = {}
    for t in sorted(ok, key=lambda t: (t.session, t.turn)):
        by_session.setdefault(t.session, []).append(t)
    moves = sum(1 for ts in by_session.values() for a, b in zip(ts, ts[1:])
                if a.result.decode_worker != b.result.decode_worker)
    # with prefill workers, the prefill side's cache is the one a turn finds ("" = prefilled locally)
    prefill_moves = sum(1 for ts in by_session.values() for a, b in zip(ts, ts[1:])
                        if a.result.prefill_worker != b.result.prefill_worker)
    per_worker: dict[str, int] = {}
    for t in ok:
        name = names.get(t.result.decode_worker, t.result.decode_worker)
        per_worker[name] = per_worker.get(name, 0) + 1
    ttft = [t.result.ttft_s * 1e3 for t in ok]
    ttft_later = [t.result.ttft_s * 1e3 for t in later]
    errors = [t.result.error for t in turns if t.result.error]
    return {
        "requests": len(ok), "errors": len(errors), "first_error": errors[0] if errors else None,
        "prompt_tokens": sum(t.result.prompt_tokens for t in ok),
        "cached_prompt_tokens": sum(t.result.cached_tokens for t in ok),
        "prompt_tokens_later_turns": sum(t.result.prompt_tokens for t in later),
        "cached_prompt_tokens_later_turns": sum(t.result.cached_tokens for t in later),
        "cached_share": share(ok), "cached_share_later_turns": share(later),
        "best_cached_share": best(ok), "best_cached_share_later_turns": best(later),
        "worker_changes_between_turns": moves, "prefill_worker_changes_between_turns": prefill_moves,
        "turn_transitions": sum(len(ts) - 1 for ts in by_session.values()),
        "ttft_ms_mean": round(sum(ttft) / len(ttft), 1) if ttft else None,
        "ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p99": round(percentile(ttft, 99), 1),
        "ttft_ms_p50_later_turns": round(percentile(ttft_later, 50), 1),
        "wall_s": round(wall_s, 2), "requests_per_decode_worker": dict(sorted(per_worker.items())),
    }


def _merge(arm_rounds: list[dict]) -> dict:
    """An arm over its rounds: token counts and moves add up, shares recomputed from them."""
    total = {k: sum(r[k] for r in arm_rounds) for k in (
        "requests", "errors", "prompt_tokens", "cached_prompt_tokens", "prompt_tokens_later_turns",
        "cached_prompt_tokens_later_turns", "worker_changes_between_turns", "turn_transitions")}
    for share, cached, prompt in (("cached_share", "cached_prompt_tokens", "prompt_tokens"),
                                  ("cached_share_later_turns", "cached_prompt_tokens_later_turns",
                                   "prompt_tokens_later_turns")):
        total[share] = round(total[cached] / total[prompt], 4) if total[prompt] else None
    return total


def bench(cfg: RoutingBenchConfig, mt: MultiTurnConfig, verbose: bool = False) -> dict:
    from services.router.server import load_tokenizer

    load_start = os.getloadavg()
    started = time.perf_counter()
    tokenizer, model_name = load_tokenizer(cfg.model)
    if tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer; the routing bench builds its prompts from text")
    rounds: list[dict] = []
    _log(f"multi-turn: starting a stack ({cfg.prefill} prefill + {mt.decode} decode, kv-aware)")
    with Stack(cfg, "kv-aware", verbose, decode=mt.decode) as stack:
        warmup = [_text_tokens(tokenizer, random.Random(k), f"Warm-up {k}:", 64) for k in range(mt.decode)]
        asyncio.run(run_requests(stack.address, warmup, "warmup", cfg, mt.decode))
        for r in range(mt.rounds):
            arms = ARMS if r % 2 == 0 else ARMS[::-1]
            entry = {}
            for arm in arms:
                _log(f"round {r + 1}/{mt.rounds}, {arm}: {mt.sessions} conversations x {mt.turns} turns, "
                     f"{cfg.concurrency} at a time")
                turns, wall = asyncio.run(run_arm(stack.address, tokenizer, cfg, mt, arm, r))
                entry[arm] = summarize_arm(turns, wall, stack.worker_names())
                _log(f"  cached share {entry[arm]['cached_share']} (later turns "
                     f"{entry[arm]['cached_share_later_turns']}, best {entry[arm]['best_cached_share_later_turns']}),"
                     f" worker changes {entry[arm]['worker_changes_between_turns']}, errors {entry[arm]['errors']}")
            entry["order"] = list(arms)
            rounds.append(entry)
            stack.check_alive()
        trouble = stack.trouble()
    totals = {arm: _merge([r[arm] for r in rounds]) for arm in ARMS}
    if any(totals[a]["requests"] == 0 for a in ARMS):
        raise StackError(f"every request of an arm failed; first: "
                         f"{next(r[a]['first_error'] for r in rounds for a in ARMS if r[a]['first_error'])}")
    key, plain = totals["key"], totals["no-key"]
    return {
        "cached_share_with_key": key["cached_share"], "cached_share_without_key": plain["cached_share"],
        "cached_share_ratio_key_vs_no_key": _ratio(key["cached_share"] or 0.0, plain["cached_share"] or 0.0),
        # the turns that have a history to find (a first turn misses under any routing)
        "cached_share_later_turns_with_key": key["cached_share_later_turns"],
        "cached_share_later_turns_without_key": plain["cached_share_later_turns"],
        "totals": totals, "rounds": rounds,
        "stack_warning_lines": len(trouble), "stack_warnings": trouble[:20],
        "config": dict(asdict(cfg), **asdict(mt), model=model_name, workload="multi-turn", policy="kv-aware",
                       threads_per_worker=1, load="closed loop, one turn after another per conversation"),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def print_table(result: dict) -> None:
    print(f"{'round':<7}{'arm':<8}{'cached share':>13}{'later turns':>12}{'best later':>11}{'moves':>7}"
          f"{'p50 TTFT':>10}  requests per decode worker")
    for i, r in enumerate(result["rounds"]):
        for arm in r["order"]:
            a = r[arm]
            spread = ", ".join(f"{w} {n}" for w, n in a["requests_per_decode_worker"].items())
            errors = f"  ({a['errors']} errors)" if a["errors"] else ""
            print(f"{i + 1:<7}{arm:<8}{a['cached_share']:>13.3f}{a['cached_share_later_turns']:>12.3f}"
                  f"{a['best_cached_share_later_turns']:>11.3f}{a['worker_changes_between_turns']:>4}/"
                  f"{a['turn_transitions']:<2}{a['ttft_ms_p50']:>8.0f}ms  {spread}{errors}")
    ratio = result["cached_share_ratio_key_vs_no_key"]
    print(f"cached-token share, all rounds: with the key {result['cached_share_with_key']:.3f}, kv-aware alone "
          f"{result['cached_share_without_key']:.3f} ({'n/a' if ratio is None else f'{ratio:.2f}x'}); turns after "
          f"the first: {result['cached_share_later_turns_with_key']:.3f} vs "
          f"{result['cached_share_later_turns_without_key']:.3f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn workload (--workload multi-turn)")
    g.add_argument("--sessions", type=int, default=8, help="conversations per arm and round")
    g.add_argument("--turns", type=int, default=4, help="turns per conversation (>= 2)")
    g.add_argument("--turn-tokens", type=int, default=32, help="user tokens each turn adds")
    g.add_argument("--rounds", type=int, default=2, help="rounds of both arms, alternating which goes first")
    g.add_argument("--decode", type=int, default=2, help="decode workers")


def config_from(args: argparse.Namespace) -> MultiTurnConfig:
    return MultiTurnConfig(sessions=args.sessions, turns=args.turns, turn_tokens=args.turn_tokens,
                           rounds=args.rounds, decode=args.decode)
