"""Probe: ``n`` = 8 as one forked generation against the old fan-out (8 requests, seed + i), on the real stack.

    PYTHONPATH=. python benchmarks/probes/choices_fork.py [--n 8] [--rounds 6] [--prompt-words 300] [--save]

One stack (``LocalStack``: 1 prefill and 1 decode worker, the default model, the router's conditional
disaggregation), the openai client streaming. Each round has a prompt of its own (no prefix cache hit
between rounds) and runs both, in alternating order:

- ``fork``: one streamed completion with ``n``, as the gateway serves it now (one queue entry; one
  decode worker computes the prompt once and forks the choices, services/engine/choices.py);
- ``fanout``: ``n`` streamed completions with seeds seed + i sent at once, what the gateway did before
  (a child request per choice through admission; their full prompt blocks shared only through the
  prefix cache, once the first child had computed them).

Per round: the prompt tokens the workers computed (``pdserve_prompt_tokens_total`` of every worker, read
from their /metrics before and after), the time to the first token of any choice (``ttft_first``) and to
the first token of every choice (``ttft_all``). Prints one JSON object with the medians, their ratios
(fanout over fork) and every round's figures; ``--save`` writes it as ``benchmarks/results/choices_fork-*``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request

from services.bench import results as result_files
from services.bench.stats import percentile, ratio
from services.launcher import LocalStack, StackSpec


def _computed(stack: LocalStack) -> float:
    total = 0.0
    for p in stack.procs.values():
        if not p.name.startswith(("prefill", "decode")) or not p.metrics:
            continue
        text = urllib.request.urlopen(f"http://{p.metrics}/metrics", timeout=10).read().decode()
        total += sum(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("pdserve_prompt_tokens_total{"))
    return total


async def _stream(client, model: str, prompt: str, started: float, firsts: dict, **kw) -> None:
    stream = await client.completions.create(model=model, prompt=prompt, stream=True, **kw)
    async for chunk in stream:
        for c in chunk.choices:
            if c.text:
                firsts.setdefault((kw.get("seed"), c.index), time.perf_counter() - started)


async def _one(base_url: str, model: str, prompt: str, mode: str, n: int, max_tokens: int) -> tuple[float, float]:
    # A client per asyncio.run: an AsyncOpenAI client's connection pool belongs to the loop it first ran on.
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        return await _timed(client, model, prompt, mode, n, max_tokens)


async def _timed(client, model: str, prompt: str, mode: str, n: int, max_tokens: int) -> tuple[float, float]:
    firsts: dict = {}
    started = time.perf_counter()
    kw = {"temperature": 1.0, "max_tokens": max_tokens}
    if mode == "fork":
        await _stream(client, model, prompt, started, firsts, n=n, seed=7, **kw)
    else:
        await asyncio.gather(*(_stream(client, model, prompt, started, firsts, seed=7 + i, **kw) for i in range(n)))
    assert len(firsts) == n, f"{mode}: {len(firsts)} of {n} choices streamed a token"
    return min(firsts.values()), max(firsts.values())


def _settled(stack: LocalStack, before: float) -> float:
    """The workers' computed prompt tokens once their stats polls caught up (they run every 0.25 s)."""
    time.sleep(1.0)
    return _computed(stack) - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    result_files.add_save_argument(parser)
    args = parser.parse_args(argv)
    words = "the harbour boats sail out at dawn and come back heavy with fish while gulls circle".split()
    spec = StackSpec(prefill=1, decode=1, threads=1, kv_cache_gb=args.kv_cache_gb)
    rounds = []
    with LocalStack(spec) as stack:
        base_url = f"http://{stack.gateway_address}/v1"
        model = asyncio.run(_first_model(base_url))
        asyncio.run(_one(base_url, model, "Warm up the workers.", "fork", 2, 2))  # load paths, not measured
        for r in range(args.rounds):
            order = ("fork", "fanout") if r % 2 == 0 else ("fanout", "fork")
            row = {"round": r}
            for mode in order:
                prompt = f"Round {r} {mode}: " + " ".join(words[(i * 7 + r) % len(words)]
                                                          for i in range(args.prompt_words))
                before = _computed(stack)
                first, every = asyncio.run(_one(base_url, model, prompt, mode, args.n, args.max_tokens))
                row[mode] = {"computed": _settled(stack, before), "ttft_first_s": first, "ttft_all_s": every}
            print(json.dumps(row), flush=True)
            rounds.append(row)

    def med(mode: str, key: str) -> float:
        return percentile([row[mode][key] for row in rounds], 50)

    summary = {mode: {key: med(mode, key) for key in ("computed", "ttft_first_s", "ttft_all_s")}
               for mode in ("fork", "fanout")}
    result = {"n": args.n, "rounds": args.rounds, "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
              "median": summary,
              "fanout_over_fork": {key: ratio(summary["fanout"][key], summary["fork"][key])
                                   for key in ("computed", "ttft_first_s", "ttft_all_s")},
              "per_round": rounds}
    result_files.save("choices_fork", result, args)
    print(json.dumps(result))
    return 0


async def _first_model(base_url: str) -> str:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        return (await client.models.list()).data[0].id


if __name__ == "__main__":
    raise SystemExit(main())
