"""``pdserve bench peer``: ``pdserve up`` against llama.cpp's ``llama-server`` on the same GGUF file, one load.

On a machine without a GPU, llama-server is the server people reach for
(continuous batching over ``-np`` slots, a prompt cache per slot, OpenAI HTTP).
The servers run one after the other on this machine: ``pdserve up`` with its
defaults (what ``pdserve up`` with no flags would start here, parsed by its own
parser: the GGUF file's own Q4/Q8 blocks), each extra ``--variant`` of it (by
default ``--quantization none``: the weights widened to bf16), then ``llama-server -np 16`` with as many
threads as cores. Each is warmed, then driven by the load generator every
serving bench shares (services/bench/load.py), closed loop: at each
``--concurrency`` level, ``max(--min-requests, --rounds x level)`` fresh
prompts (40-120 words, a new set per level), then the same prompts again (the
repeated-prompt pass: cached on both servers). Requests are streaming chat with
``stream_options.include_usage``, greedy, ``--max-tokens`` each with
``ignore_eos`` (every request produces the same number of tokens on both
servers). Per server, level and pass: output tok/s (completion tokens over the
pass's wall time), TTFT and inter-token latency (ITL: every gap between content
chunks) p50/p90/p99, TPOT (per request, (last - first chunk) / (tokens - 1):
what guidellm and aiperf call ITL, which tokens delivered in bursts do not
lower), and errors; the ratios are pdserve over llama-server.

Greedy check: after the levels, ``--check`` prompts of the largest level go
again one at a time (batch 1); each server's batched answers to them (fresh and
cached passes) are compared with its own batch-1 answers.

Without a llama-server binary the bench says how to get it
(``scripts/build_llama_server.sh``) and runs pdserve alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

from services.bench import llama_server
from services.bench import results as result_files
from services.bench.http_client import Connection
from services.bench.load import OpenAIClient, OpenAIRequest, closed_loop
from services.bench.stats import ratio, summarize

LLAMA = "llama-server"
DEFAULT_VARIANTS = ("pdserve=", "pdserve-bf16=--quantization none")
# the --json keys the issue names: (key, level, pass, metric), each pdserve over llama-server
HEADLINE = (("throughput_ratio_c1", 1, "fresh", "output_tok_s"),
            ("throughput_ratio_c16", 16, "fresh", "output_tok_s"),
            ("throughput_ratio_c32", 32, "fresh", "output_tok_s"),
            ("ttft_p90_ratio_c16", 16, "fresh", "ttft_ms_p90"),
            ("ttft_p90_ratio_c32", 32, "fresh", "ttft_ms_p90"),
            ("cached_ttft_p50_ratio_c1", 1, "cached", "ttft_ms_p50"),
            ("cached_ttft_p90_ratio_c16", 16, "cached", "ttft_ms_p90"))
_WORDS = ("river stone light garden window paper engine market silver forest music winter harbor signal letter "
          "mountain yellow planet bridge candle orange theory coffee island rocket thunder velvet marble dragon "
          "pencil castle meadow falcon lantern puzzle canyon").split()
_TASKS = ("Write a short story that uses these words:", "Explain how these things are connected:",
          "Make a list of questions about:", "Describe a journey past:")


def workload(seed: int, n: int) -> list[str]:
    """``n`` chat prompts of 40-120 words, all different from their first words on (no shared prefix)."""
    rng = random.Random(seed)
    return [f"{rng.choice(_TASKS)} {i} {seed} " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(40, 120)))
            for i in range(n)]


def _summary(samples, wall: float) -> dict:
    s = summarize(samples, wall, slo_ttft_s=float("inf"), slo_itl_s=float("inf"))
    for key in ("goodput_req_s",):
        s.pop(key)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()}


async def drive(host: str, port: int, args) -> dict:
    """Warm one server, run every level's fresh and repeated pass, then the batch-1 greedy check."""
    models = await Connection(host, port).request("GET", "/v1/models")
    model = json.loads(models.body)["data"][0]["id"]
    client = OpenAIClient(host, port, model, timeout_s=args.request_timeout)

    def items(prompts: list[str]) -> list[OpenAIRequest]:
        return [OpenAIRequest("chat", p, args.max_tokens, extra={"ignore_eos": True}) for p in prompts]

    warm = items(workload(args.seed + 999, max(4, min(args.concurrency))))
    await closed_loop(client.send, warm, len(warm))  # first-call costs (compilation, pools) out of the figures
    levels, batched = [], {}
    for i, clients in enumerate(args.concurrency):
        prompts = workload(args.seed + i, max(args.min_requests, args.rounds * clients))
        row = {"concurrency": clients, "requests": len(prompts)}
        for name in ("fresh", "cached"):
            samples, wall = await closed_loop(client.send, items(prompts), clients)
            row[name] = _summary(samples, wall)
            batched[name] = dict(zip(prompts, (s.text if s.ok else None for s in samples)))
            _log(f"  {clients:>3} streams, {name:<6}: {row[name]['output_tok_s']:7.1f} tok/s, TTFT p50/p90 "
                 f"{row[name]['ttft_ms_p50']:.0f}/{row[name]['ttft_ms_p90']:.0f} ms, ITL p50 "
                 f"{row[name]['itl_ms_p50']:.1f} ms, TPOT p50 {row[name]['tpot_ms_p50']:.1f} ms, "
                 f"{row[name]['failed']} failed")
        levels.append(row)
    check = list(batched.get("fresh", {}))[:args.check]
    alone = [await client.send(item) for item in items(check)]
    greedy = {"prompts": len(check), "batch1_failed": sum(not s.ok for s in alone)}
    for name in ("fresh", "cached"):
        same = [batched[name].get(p) == s.text for p, s in zip(check, alone) if s.ok]
        greedy[f"{name}_identical"] = sum(same)
    return {"levels": levels, "greedy_check": greedy}


def _up_spec(flags: list[str], kv_cache_gb: float):
    """What ``pdserve up FLAGS`` would start (its own parser and defaults), on free ports."""
    from services import up

    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    args = parser.parse_args(["up", *flags, "--port", "0", "--grpc-port", "-1", "--router-port", "0",
                              *(["--kv-cache-gb", str(kv_cache_gb)] if "--kv-cache-gb" not in flags else [])])
    return up.spec_from_args(args)


def run_pdserve(name: str, flags: list[str], args) -> dict:
    from services.launcher import LocalStack

    spec = _up_spec([*flags, *(["--model", args.model] if args.model else [])], args.kv_cache_gb)
    config = {"up_flags": " ".join(flags) or "(defaults)", "prefill": spec.prefill, "decode": spec.decode,
              "threads": spec.threads, "quantization": spec.quantization or "none", "dtype": spec.dtype,
              "kv_cache_gb": spec.kv_cache_gb, "router_args": spec.router_args}
    _log(f"{name}: pdserve up {config['up_flags']} ({spec.prefill} prefill + {spec.decode} decode, "
         f"{spec.threads or 'default'} threads, {config['quantization']} weights)")
    started = time.perf_counter()
    with LocalStack(spec) as stack:
        config["start_s"] = round(time.perf_counter() - started, 1)
        host, port = stack.gateway_address.rsplit(":", 1)
        out = asyncio.run(drive(host, int(port), args))
    return {"config": config, **out}


def run_llama(binary: Path, gguf: Path, args) -> dict:
    extra = [*(args.llama_arg or []), *(["--no-repack"] if args.llama_no_repack else [])]
    server = llama_server.LlamaServer(binary, gguf, parallel=args.llama_np, threads=args.llama_threads,
                                      batch=args.llama_batch, extra=extra)
    _log(f"{LLAMA}: {server.describe()} ({llama_server.version(binary)})")
    started = time.perf_counter()
    try:
        server.start()
    except llama_server.LlamaServerError as exc:
        if "--no-repack" in extra or exc.returncode != -11:
            raise
        # A native build on an AMX CPU crashes repacking the weights for AMX at load
        # (ggml-org/llama.cpp#20824); without repacking it runs.
        _log(f"{LLAMA} crashed at load (SIGSEGV: the AMX repacking crash, ggml-org/llama.cpp#20824); "
             "running it with --no-repack")
        server = llama_server.LlamaServer(binary, gguf, parallel=args.llama_np, threads=args.llama_threads,
                                          batch=args.llama_batch, extra=[*extra, "--no-repack"])
        server.start()
    try:
        # the command as a user would type it: the model by its file name, no machine paths or ports
        argv = [gguf.name if a == str(gguf) else a for a in server.argv[1:]]
        del argv[argv.index("--port"):argv.index("--port") + 2]
        config = {"argv": " ".join(shlex.quote(a) for a in argv), "np": args.llama_np,
                  "threads": args.llama_threads, "batch": args.llama_batch, "version": llama_server.version(binary),
                  "binary": f"{binary.parent.name}/{binary.name}", "start_s": round(time.perf_counter() - started, 1)}
        out = asyncio.run(drive(server.host, server.port, args))
    finally:
        server.stop()
    return {"config": config, **out}


def _level(server: dict, clients: int) -> dict | None:
    return next((row for row in server["levels"] if row["concurrency"] == clients), None)


def ratios(ours: dict, theirs: dict) -> dict:
    out = {}
    for key, clients, name, metric in HEADLINE:
        a, b = _level(ours, clients), _level(theirs, clients)
        out[key] = ratio(a[name][metric], b[name][metric]) if a and b else None
    return out


def _variants(raw: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for text in raw:
        name, sep, flags = text.partition("=")
        if not sep or not name or name == LLAMA:
            raise ValueError(f"--variant {text!r}: expected NAME=UP_FLAGS (NAME not {LLAMA!r})")
        out.append((name, shlex.split(flags)))
    return out


def gguf_of(model: str | None) -> Path | None:
    from services.engine.model_source import default_model_path

    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def collect(args) -> dict:
    if not args.concurrency or min(args.concurrency) < 1 or args.max_tokens < 2 or args.rounds < 1 \
            or args.min_requests < 1 or args.check < 0:
        raise ValueError("concurrency levels, rounds and min-requests must be >= 1, max-tokens >= 2, check >= 0")
    variants = _variants(args.variant or list(DEFAULT_VARIANTS))
    binary = llama_server.find(args.llama_server)
    gguf = gguf_of(args.model)
    result: dict = {"servers": {}, "llama_server": {"found": binary is not None}}
    if binary is None:
        _log(llama_server.HOW_TO_GET + "; running pdserve alone")
        result["llama_server"]["how_to_get"] = llama_server.HOW_TO_GET
    elif gguf is None:
        _log(f"{LLAMA} needs a .gguf model; --model {args.model} is not one: running pdserve alone")
        binary = None
    if args.only == LLAMA and binary is None:
        raise ValueError(f"--only {LLAMA} needs the {LLAMA} binary: {llama_server.HOW_TO_GET}")
    order = ([] if args.only == LLAMA else variants) + ([(LLAMA, [])] if binary and args.only != "pdserve" else [])
    for name, flags in order:
        result["servers"][name] = run_llama(binary, gguf, args) if name == LLAMA else run_pdserve(name, flags, args)
    theirs = result["servers"].get(LLAMA)
    if theirs is not None:
        result["ratios"] = {name: ratios(server, theirs) for name, server in result["servers"].items()
                            if name != LLAMA}
        first = next(iter(result["ratios"].values()), {})
        result.update(first)  # the keys at the top: pdserve's defaults over llama-server
    result["errors"] = sum(row[p]["failed"] for s in result["servers"].values() for row in s["levels"]
                           for p in ("fresh", "cached"))
    result["config"] = {"concurrency": args.concurrency, "rounds": args.rounds, "min_requests": args.min_requests,
                        "max_tokens": args.max_tokens, "prompt_words": "40-120", "api": "chat, streaming",
                        "greedy": True, "ignore_eos": True, "model": gguf.name if gguf else (args.model or "default"),
                        "cpus": os.cpu_count(), "order": [name for name, _ in order]}
    return result


def run(args) -> int:
    result = collect(args)
    result_files.report("peer", result, args, print_table)
    return 0 if result["errors"] == 0 else 1


def print_table(result: dict) -> None:
    servers = result["servers"]
    for name, s in servers.items():
        c = s["config"]
        how = c.get("argv") or f"pdserve up {c['up_flags']}: {c['prefill']} prefill + {c['decode']} decode, " \
                               f"{c['threads'] or 'default'} threads, {c['quantization']} weights"
        print(f"{name}: {how}")
    print(f"\n{'streams':>7} {'pass':<6} {'server':<14} {'tok/s':>7} {'TTFT p50/p90/p99 ms':>22} "
          f"{'ITL p50/p90/p99 ms':>20} {'TPOT p50 ms':>11} {'failed':>6}")
    levels = [row["concurrency"] for row in next(iter(servers.values()))["levels"]] if servers else []
    for clients in levels:
        for name in ("fresh", "cached"):
            for server, s in servers.items():
                r = _level(s, clients)[name]
                print(f"{clients:>7} {name:<6} {server:<14} {r['output_tok_s']:>7.1f} "
                      f"{r['ttft_ms_p50']:>8.0f}/{r['ttft_ms_p90']:.0f}/{r['ttft_ms_p99']:.0f} "
                      f"{r['itl_ms_p50']:>9.1f}/{r['itl_ms_p90']:.1f}/{r['itl_ms_p99']:.1f} "
                      f"{r['tpot_ms_p50']:>11.1f} {r['failed']:>6}")
    for server, s in servers.items():
        g = s["greedy_check"]
        print(f"greedy check, {server}: of {g['prompts']} prompts at batch 1, identical when batched: fresh "
              f"{g['fresh_identical']}, repeated {g['cached_identical']}")
    for server, r in (result.get("ratios") or {}).items():
        print(f"{server} / {LLAMA}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    if not result["llama_server"]["found"]:
        print(f"\n{result['llama_server']['how_to_get']}")
    print(f"errors: {result['errors']}")


def _log(msg: str) -> None:
    print(f"[bench peer] {msg}", file=sys.stderr, flush=True)


def _levels(text: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("peer", help="pdserve up against llama.cpp's llama-server, same GGUF file, same load",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--concurrency", type=_levels, default=[1, 8, 16, 32], help="closed-loop streams per level")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream at each level and pass")
    p.add_argument("--min-requests", type=int, default=6, help="requests per level and pass at least")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--check", type=int, default=4, help="prompts of the largest level compared with batch 1")
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--variant", action="append", default=None, metavar="NAME=UP_FLAGS",
                   help="a pdserve configuration to run, as `pdserve up` flags (repeatable; default: "
                        f"{' and '.join(repr(v) for v in DEFAULT_VARIANTS)}); the first one's ratios are the "
                        "top-level keys")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="pdserve's KV cache per worker")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary (default: $PDSERVE_LLAMA_SERVER, what "
                        "scripts/build_llama_server.sh built, or PATH)")
    p.add_argument("--llama-np", type=int, default=16, help="llama-server --parallel slots")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1, help="llama-server threads")
    p.add_argument("--llama-batch", type=int, default=None, help="llama-server -b (default: its own)")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="one more llama-server argument (repeatable), e.g. --llama-arg=--poll --llama-arg=0")
    p.add_argument("--llama-no-repack", action="store_true",
                   help="llama-server --no-repack (without it, a build that crashes repacking is retried with it)")
    p.add_argument("--only", default=None, choices=["pdserve", LLAMA],
                   help="run one side alone (tuning llama-server's settings, comparing pdserve configurations)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
