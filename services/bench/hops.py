"""``pdserve bench hops``: where a cached request's first token waits, hop by hop, alone and under load.

The stack is ``pdserve up``'s (services/launcher.py, with the router flags ``pdserve up`` adds: local
prefill of short uncached prompts on the decode worker), started with the hop probe on
(``PDSERVE_HOPS_DIR``, services/hops.py): every process writes a timestamp per hop per
request. For each ``--concurrency`` level, a fresh set of chat prompts (40-120 words)
goes through the shared load generator twice: once to put them in the caches, then the
same prompts again, which is what is measured (the issue's "cached prompts"): each
request's client TTFT, and between consecutive hops of its first token the time spent
there (p50 / p90 over the level's requests)::

    gw.arrive -> gw.enqueue -> router.read -> router.placed -> router.sent
      -> decode.recv (or, through a prefill worker: prefill.recv -> decode.kv)
      -> decode.token -> decode.written -> gw.delivered -> gw.sse

and beside that path, gw.enqueue -> gw.queued (the gateway's own queue write) and, through a
prefill worker, router.sent -> decode.recv (the Decode call made while the prefill computes) and
prefill.recv -> prefill.done (its call, which returns once the KV landed);
plus the engine steps from the request reaching the decode worker (its KV, when a prefill
worker computed it) to the step that made the first token, and how many requests the
router sent through a prefill worker.

``--baseline-router-arg FLAG`` starts a second, identical stack whose router gets FLAG
(e.g. ``--no-local-prefill-cached``: the hand-off every cached prompt took before) and
runs each level's requests in blocks pdserve, baseline, baseline, pdserve, printing the
cached TTFT ratios. ``--batch1-rounds`` adds one user's served speed against the engine's
own batch-1 decode in this process, the two alternating request by request (same model,
dtype and threads), so drift cancels, with each process's CPU time per served token.

Clocks: every mark is ``time.time_ns()`` on one host (one CLOCK_REALTIME); a hop that
comes out negative (a mark before its predecessor) is counted in ``clock_violations``,
which must stay 0 for the split to be read (hops beside the path are not in that order).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

from services import hops, openmp_env
from services.bench import results as result_files
from services.bench.args import at_least_one as count
from services.bench.args import counts
from services.bench.load import OpenAIClient, OpenAIRequest, closed_loop
from services.bench.process_watch import cpu_seconds, wakeups
from services.bench.stats import percentile, ratio
from services.up import engine_nice_arg

_WORDS = ("river stone light garden window paper engine market silver forest music winter harbor signal "
          "letter mountain yellow planet bridge candle orange theory coffee island rocket thunder velvet "
          "marble dragon pencil castle meadow falcon lantern puzzle canyon").split()


def prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Note {seed}-{i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(40, 120)))
            + "\nSummarize the note in one sentence." for i in range(n)]


def split(marks: dict[str, dict]) -> dict[str, float]:
    """One request's hops (ms from the previous hop present), the first-token path in order."""
    out = {}
    for before, after in hops.first_token_path(marks):
        out[f"{before}->{after}"] = (marks[after]["t"] - marks[before]["t"]) / 1e6
    if "gw.arrive" in marks and "gw.sse" in marks:
        out["total"] = (marks["gw.sse"]["t"] - marks["gw.arrive"]["t"]) / 1e6
    return out


def summarize_level(samples, marks: dict[str, dict[str, dict]]) -> dict:
    ok = [s for s in samples if s.ok]
    per_hop: dict[str, list[float]] = {}
    steps, via_prefill, violations, traced = [], 0, 0, 0
    for s in ok:
        m = marks.get(s.request_id)
        if not m:
            continue
        traced += 1
        for hop, ms in split(m).items():
            per_hop.setdefault(hop, []).append(ms)
            violations += ms < 0
        arrived = m.get("decode.kv") or m.get("decode.recv")  # with a prefill worker: once its KV is here
        if arrived and "decode.token" in m and m["decode.token"].get("step") is not None:
            steps.append(m["decode.token"]["step"] - arrived["step"])
        via_prefill += "prefill.recv" in m
    ttft = [s.ttft * 1e3 for s in ok]
    return {
        "requests": len(samples), "failed": len(samples) - len(ok), "traced": traced,
        "ttft_ms_p50": round(percentile(ttft, 50), 2), "ttft_ms_p90": round(percentile(ttft, 90), 2),
        "hops_ms": {hop: {"n": len(v), "p50": round(percentile(v, 50), 3), "p90": round(percentile(v, 90), 3)}
                    for hop, v in per_hop.items()},
        "engine_steps_to_first_token": {"p50": percentile(steps, 50), "max": max(steps) if steps else None},
        "via_prefill_worker": via_prefill, "clock_violations": violations,
    }


# With a baseline stack, each level's requests run in blocks pdserve, baseline, baseline, pdserve (the
# same prompts in block b of both): a machine whose speed drifts slows both alike.
_ORDER = (("pdserve", 0), ("baseline", 0), ("baseline", 1), ("pdserve", 1))


async def _block(client: OpenAIClient, texts: list[str], streams: int, max_tokens: int):
    """Fresh prompts once (they fill the caches), then the same again: the cached pass's samples and wall."""
    items = [OpenAIRequest("chat", p, max_tokens) for p in texts]
    await closed_loop(client.send, items, streams)
    await asyncio.sleep(0.3)  # KV events reach the router's index
    samples, wall = await closed_loop(client.send, items, streams)
    await asyncio.sleep(0.3)  # the last marks are written
    return samples, wall


async def _levels(args, sides: dict[str, tuple[OpenAIClient, str]]) -> dict:
    levels = {}
    for i, c in enumerate(args.concurrency):
        n = max(args.requests, 2 * c)
        texts = prompts(args.seed + i, n)
        order = _ORDER if "baseline" in sides else (("pdserve", 0),)
        blocks = [texts[:n // 2], texts[n // 2:]] if "baseline" in sides else [texts]
        _log(f"{c} stream(s): {n} fresh prompts (fills the caches), then the same {n} again"
             + (" on each stack, in blocks pdserve, baseline, baseline, pdserve" if "baseline" in sides else ""))
        got: dict[str, tuple[list, float]] = {name: ([], 0.0) for name in sides}
        for name, b in order:
            samples, wall = await _block(sides[name][0], blocks[b], c, args.max_tokens)
            got[name] = (got[name][0] + samples, got[name][1] + wall)
        level = {}
        for name, (samples, wall) in got.items():
            side = summarize_level(samples, hops.read(sides[name][1]))
            side["output_tok_s"] = round(sum(s.tokens for s in samples if s.ok) / wall, 1)
            level[name] = side
            _log(f"  {name}: cached TTFT p50 {side['ttft_ms_p50']:.1f} ms, p90 {side['ttft_ms_p90']:.1f} ms; "
                 f"{side['via_prefill_worker']} of {side['traced']} through a prefill worker")
        if "baseline" in level:
            level["cached_ttft_p50_ratio"] = ratio(level["pdserve"]["ttft_ms_p50"], level["baseline"]["ttft_ms_p50"])
            level["cached_ttft_p90_ratio"] = ratio(level["pdserve"]["ttft_ms_p90"], level["baseline"]["ttft_ms_p90"])
        levels[str(c)] = level
    return levels


def _cpu_seconds(procs: dict) -> dict[str, float]:
    """``cpu_seconds`` with each decode worker's event-loop thread (its main one) apart from its engine's too."""
    out = cpu_seconds(procs)
    for name, proc in procs.items():
        if name.startswith("decode"):
            try:
                main = next(th for th in proc.threads() if th.id == proc.pid)
                out[f"{name} loop"] = main.user_time + main.system_time
            except Exception:  # gone: counts nothing more
                out[f"{name} loop"] = 0.0
    return out


async def _idle(procs: dict, seconds: float) -> dict:
    """Each process's CPU (ms a second) and wake-ups a second over ``seconds`` with no request: what the
    stack's polling, heartbeats and metrics loops cost whatever it serves."""
    await asyncio.sleep(1.0)  # the warm-up's last writes and acks are done
    cpu0, woke0, t0 = cpu_seconds(procs), wakeups(procs), time.monotonic()
    await asyncio.sleep(seconds)
    cpu1, woke1, dt = cpu_seconds(procs), wakeups(procs), time.monotonic() - t0
    _log(f"idle for {dt:.1f} s: " + ", ".join(f"{n} {(cpu1[n] - cpu0[n]) / dt * 1e3:.1f} ms/s" for n in procs))
    return {name: {"cpu_ms_per_s": round((cpu1[name] - cpu0[name]) / dt * 1e3, 2),
                   "wakeups_per_s": round((woke1[name] - woke0[name]) / dt, 1)} for name in procs}


async def _batch1(args, client: OpenAIClient, stack) -> dict:
    """One user's served decode rate against the engine's batch-1 decode here, alternating; and the CPU
    time each process of the stack spent per served token (where a token's serving cost goes)."""
    import psutil
    import redis

    from services.config import EngineConfig
    from services.engine.bench import pdserve_decode_b1
    from services.engine.engine import Engine
    from services.registry import redis_client_options

    import torch

    pids = {name: p.proc.pid for name, p in stack.procs.items()}
    pids["redis"] = int(redis.Redis.from_url(stack.redis_url, **redis_client_options()).info("server")["process_id"])
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    procs["client"] = psutil.Process()  # this process: during a served round it only reads the stream
    cpu = dict.fromkeys(_cpu_seconds(procs), 0.0)
    woke = dict.fromkeys(procs, 0)
    served_tokens = 0
    idle = await _idle(procs, args.idle_seconds) if args.idle_seconds else None

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization))
    prompt = engine.tokenizer.encode(prompts(args.seed + 99, 1)[0])[:64]
    served, alone = [], []
    texts = prompts(args.seed + 100, args.batch1_rounds)
    pdserve_decode_b1(engine, prompt, 8, "warm")
    for k, text in enumerate(texts):
        before, woke_before = _cpu_seconds(procs), wakeups(procs)
        s = await client.send(OpenAIRequest("chat", text, args.batch1_tokens, extra={"ignore_eos": True}))
        after, woke_after = _cpu_seconds(procs), wakeups(procs)
        if s.ok and s.tokens > 1:
            served.append((s.tokens - 1) / (s.e2e - s.ttft))
            served_tokens += s.tokens
            for name in cpu:
                cpu[name] += after.get(name, 0.0) - before.get(name, 0.0)
            for name in woke:
                woke[name] += woke_after[name] - woke_before[name]
        alone.append(pdserve_decode_b1(engine, prompt, args.batch1_tokens, f"b1-{k}"))
    out = {"rounds": len(texts), "served_tok_s_p50": round(percentile(served, 50), 1),
           "engine_tok_s_p50": round(percentile(alone, 50), 1),
           "cpu_ms_per_token": {name: round(seconds / max(served_tokens, 1) * 1e3, 3)
                                for name, seconds in cpu.items()},
           # the client's include this bench's other threads; the decode worker's its engine's OpenMP threads
           "wakeups_per_token": {name: round(n / max(served_tokens, 1), 2) for name, n in woke.items()}}
    if idle is not None:
        out["idle"] = idle
    out["served_over_engine"] = ratio(out["served_tok_s_p50"], out["engine_tok_s_p50"])
    _log(f"batch 1: served {out['served_tok_s_p50']} tok/s, engine alone {out['engine_tok_s_p50']} tok/s "
         f"({out['served_over_engine']}x)")
    return out


async def _run(args, stacks: dict, hops_dirs: dict[str, str]) -> dict:
    sides = {}
    for name, stack in stacks.items():
        host, port = stack.gateway_address.rsplit(":", 1)
        client = OpenAIClient(host, int(port), args.model_name)
        for k in range(2):  # warm-up: first-call costs are not measured
            await client.send(OpenAIRequest("chat", f"Warm up {k}.", 4))
        sides[name] = (client, hops_dirs[name])
    result = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "router_args": args.router_arg,
              "engine_nice": args.engine_nice, "worker_args": args.worker_arg,
              "decode_args": args.decode_arg, "omp_env": {k: os.environ.get(k) for k in openmp_env.USER_SETTINGS},
              "baseline_router_args": args.baseline_router_arg if "baseline" in stacks else None,
              "levels": await _levels(args, sides)}
    if args.batch1_rounds:
        result["batch1"] = await _batch1(args, sides["pdserve"][0], stacks["pdserve"])
    return result


def run(args) -> int:
    import contextlib

    from services.launcher import LocalStack, StackSpec

    from services.up_defaults import choose

    # the router flags `pdserve up` adds for 1 prefill + 1 decode (local prefill of short prompts), unless
    # given: without them every fresh prompt, the batch-1 rounds' included, went through the prefill worker
    # and its prompt compute was counted as an idle prefill worker's CPU per served token
    given = any(a.startswith("--local-prefill-max-tokens") for a in args.router_arg + args.baseline_router_arg)
    up = choose(os.cpu_count() or 1, prefill=1, decode=1, threads=0, quantization="none",
                local_prefill_given=given, engine_nice=args.engine_nice)
    up_args = up.router_args
    args.engine_nice = up.engine_nice  # `pdserve up`'s default (19) unless given: the stack a user runs
    args.router_arg = up_args + list(args.router_arg)
    router_args = {"pdserve": list(args.router_arg)}
    if args.baseline_router_arg:
        args.baseline_router_arg = up_args + list(args.baseline_router_arg)
        router_args["baseline"] = list(args.baseline_router_arg)
    hops_dirs = {name: tempfile.mkdtemp(prefix=f"pdserve-hops-{name}-") for name in router_args}
    with contextlib.ExitStack() as exit_stack:
        stacks = {}
        for name, extra in router_args.items():
            os.environ[hops.ENV] = hops_dirs[name]  # the stack's processes inherit it
            try:
                spec = StackSpec(prefill=1, decode=1, model=args.model, dtype=args.dtype,
                                 quantization=args.quantization, threads=args.threads,
                                 kv_cache_gb=args.kv_cache_gb, router_args=extra, engine_nice=args.engine_nice,
                                 worker_args=list(args.worker_arg), decode_args=list(args.decode_arg))
                _log(f"starting the {name} stack, router flags {extra or 'default'} (hop marks in "
                     f"{hops_dirs[name]})")
                stacks[name] = exit_stack.enter_context(LocalStack(spec))
            finally:
                os.environ.pop(hops.ENV, None)
        import httpx

        args.model_name = httpx.get(f"http://{stacks['pdserve'].gateway_address}/v1/models",
                                    timeout=30).json()["data"][0]["id"]
        started = time.time()
        result = asyncio.run(_run(args, stacks, hops_dirs))
        result["wall_s"] = round(time.time() - started, 1)
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    result_files.report("hops", result, args, print_table)
    return 0


def print_table(result: dict) -> None:
    for c, sides in result["levels"].items():
        for name, level in sides.items():
            if isinstance(level, dict):
                _print_side(f"{c} stream(s), {name}", level)
        if "cached_ttft_p50_ratio" in sides:
            print(f"\n{c} stream(s): cached TTFT pdserve / baseline p50 {sides['cached_ttft_p50_ratio']}x, "
                  f"p90 {sides['cached_ttft_p90_ratio']}x")
    if "batch1" in result:
        b = result["batch1"]
        print(f"\nbatch 1: served {b['served_tok_s_p50']} tok/s, engine alone {b['engine_tok_s_p50']} tok/s "
              f"({b['served_over_engine']}x, {b['rounds']} rounds alternating)")
        print("  CPU ms per served token: " + ", ".join(f"{k} {v:.2f}" for k, v in b["cpu_ms_per_token"].items()))
        if "wakeups_per_token" in b:
            print("  wake-ups per served token: " + ", ".join(f"{k} {v:.2f}" for k, v in b["wakeups_per_token"].items()))
        for name, row in b.get("idle", {}).items():
            print(f"  idle {name}: {row['cpu_ms_per_s']:.1f} ms CPU a second, {row['wakeups_per_s']:.0f} wake-ups a second")


def _print_side(title: str, level: dict) -> None:
    print(f"\n{title}, cached prompts: TTFT p50 {level['ttft_ms_p50']:.1f} ms, p90 "
          f"{level['ttft_ms_p90']:.1f} ms; {level['traced']} traced, {level['via_prefill_worker']} through "
          f"a prefill worker; engine steps to the first token p50 "
          f"{level['engine_steps_to_first_token']['p50']}, max {level['engine_steps_to_first_token']['max']}; "
          f"clock violations {level['clock_violations']}")
    print(f"  {'hop':<36}{'n':>5}{'p50 ms':>10}{'p90 ms':>10}")
    for hop, row in level["hops_ms"].items():
        print(f"  {hop:<36}{row['n']:>5}{row['p50']:>10.2f}{row['p90']:>10.2f}")


def _log(msg: str) -> None:
    print(f"[bench hops] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("hops", help="where a cached request's first token waits, hop by hop (gateway, queue, "
                                    "router, workers, delivery), alone and at 16 and 32 streams",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--concurrency", type=counts, default=[1, 16, 32], help="streams, comma-separated")
    p.add_argument("--requests", type=count, default=12, help="requests per level (at least 2x its streams)")
    p.add_argument("--max-tokens", type=count, default=32, help="output tokens per request")
    p.add_argument("--batch1-rounds", type=int, default=0,
                   help="also measure one user's served tok/s against the engine's batch-1 decode, this many "
                        "alternating rounds (0: skip)")
    p.add_argument("--batch1-tokens", type=count, default=128, help="output tokens per batch-1 round")
    p.add_argument("--idle-seconds", type=float, default=10.0,
                   help="with --batch1-rounds: first read each process's CPU and wake-ups a second this long with "
                        "no request (0: skip)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="an extra router flag (repeat; e.g. --router-arg=--no-local-prefill-cached)")
    p.add_argument("--baseline-router-arg", action="append", default=[],
                   help="also start a baseline stack whose router gets this flag (repeat), and alternate the "
                        "two in blocks (e.g. --baseline-router-arg=--no-local-prefill-cached: the hand-off "
                        "every cached prompt took before)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="an extra flag for every worker (repeat; e.g. --worker-arg=--loop=asyncio)")
    p.add_argument("--decode-arg", action="append", default=[],
                   help="an extra flag for the decode worker (repeat; e.g. --decode-arg=--stream-interval=4)")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per worker")
    p.add_argument("--engine-nice", type=engine_nice_arg, default=None, metavar="N",
                   help="the engine workers' autogroup niceness 0-19 (default: pdserve up's, 19)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: the workers')")
    p.add_argument("--dtype", default="bf16", help="worker dtype")
    p.add_argument("--quantization", default=None, help="workers' --quantization (int8, gguf)")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
