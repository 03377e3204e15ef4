"""``pdserve bench loadtools``: guidellm and aiperf against the stack, beside pdserve's own load, on one load.

The standard load tools, run as a user would run them against ``pdserve up``
(the commands are printed, and BENCHMARKS.md shows them), on the same load as
``pdserve bench serve``'s generator: arrivals at ``--rate`` (``--arrivals
constant``, the default, spaces them evenly, so every tool sends the same
schedule; ``poisson`` draws each tool's own), ``--requests`` streaming
``/v1/completions`` per block, prompts of exactly ``--prompt-tokens`` tokens
(as the tools' synthetic prompts are), exactly ``--output-tokens``
(``ignore_eos``). Blocks run in the order
pdserve, guidellm, aiperf, aiperf, guidellm, pdserve, so a machine whose speed
drifts slows every tool alike; each tool's two blocks are pooled. It prints each
tool's TTFT p50, inter-token latency p50 and output throughput, and their ratios
to pdserve's generator (the issue's goal: within 10%), and each client's own CPU
time (the tools' processes share the cores with the stack they measure).

One definition per metric, the tools': TTFT from sending the request to the
first content chunk; inter-token latency per request as ``(last content chunk -
first content chunk) / (output tokens - 1)``, then the median over requests
(guidellm and aiperf both; pdserve's generator's own ``itl_ms`` elsewhere is
the median of all gaps between chunks, reported here as ``chunk_gap_ms``).

Installing: each tool in its own virtualenv under ``~/.cache/pdserve/loadtools``
(``$PDSERVE_LOADTOOLS_DIR``), created with ``--system-site-packages`` so the
tools reuse this environment's torch and transformers and pip never replaces
them; one each because their pins differ (pandas). ``python -m
services.bench.loadtools install`` does it ahead; the bench does it on demand.

Tokenizer without a hub: the served model's tokenizer files laid out as a local
Hugging Face cache (``models--pdserve--<model>``), read with
``HF_HUB_OFFLINE=1``. Given a plain directory instead, aiperf (0.13) still asks
the hub about it and waits for the connection to time out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.bench import results as result_files
from services.bench.stats import percentile as pct
from services.bench.stats import ratio, time_per_output_token

TOOLS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}
_ORDER = ("pdserve", "guidellm", "aiperf", "aiperf", "guidellm", "pdserve")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def tools_dir() -> Path:
    return Path(os.environ.get("PDSERVE_LOADTOOLS_DIR") or Path.home() / ".cache" / "pdserve" / "loadtools")


def tool_bin(tool: str) -> Path:
    return tools_dir() / tool / "bin" / tool


def ensure_tools(tools=tuple(TOOLS)) -> None:
    """Create each tool's virtualenv and install it, once (a no-op when it runs already)."""
    for tool in tools:
        if tool_bin(tool).exists():
            continue
        venv = tools_dir() / tool
        _log(f"installing {TOOLS[tool]} into {venv} (once; reuses this environment's torch)")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        TOOLS[tool]], check=True)


def tokenizer_cache(model: str | None) -> tuple[Path, str]:
    """(HF cache dir, repo id) holding only the served model's tokenizer: what the tools load offline."""
    from services.engine.model_source import model_card

    resolved = model_card(model)  # the tokenizer files only: no weights converted, no torch
    name = Path(resolved.tokenizer_dir).name.split(".")[0]
    repo = f"pdserve/{name}"
    cache = tools_dir() / "hf-cache"
    snapshot = cache / f"models--pdserve--{name}" / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in _TOKENIZER_FILES:
        if (Path(resolved.tokenizer_dir) / file).exists():
            shutil.copyfile(Path(resolved.tokenizer_dir) / file, snapshot / file)
    if not (snapshot / "config.json").exists():
        # transformers 5.2x's AutoTokenizer reads the model's config before the tokenizer's (a GGUF's
        # tokenizer files come without one) and, offline, fails without it; the tokenizer class still
        # comes from tokenizer_config.json. pdserve serves Llama-architecture models.
        (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text("local")
    return cache, repo


# guidellm starts up to 10 worker processes by default (settings.max_worker_processes), each polling
# its queues: about half a core of a 2-core machine (20 s of CPU per 41 s block, measured), taken from
# the stack it measures. One worker holds thousands of concurrent requests; aiperf runs with --workers-max 1.
GUIDELLM_ENV = {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}


def offline_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf"),
            **GUIDELLM_ENV}


def guidellm_command(url: str, model: str, tokenizer: str, args, out: Path) -> list[str]:
    return [str(tool_bin("guidellm")), "run",
            "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
            "--profile", f"kind={args.arrivals},rate={args.rate}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def aiperf_command(url: str, model: str, tokenizer: str, args, out: Path, seed: int) -> list[str]:
    return [str(tool_bin("aiperf")), "profile", "--model", model, "--url", url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", tokenizer, "--use-server-token-count",
            "--synthetic-input-tokens-mean", str(args.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--request-rate", str(args.rate),
            "--arrival-pattern", args.arrivals,
            "--request-count", str(args.requests), "--num-dataset-entries", str(args.requests),
            "--workers-max", "1", "--record-processors", "1", "--random-seed", str(seed),
            "--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"]


def read_guidellm(path: Path) -> dict:
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    return {"requests": totals["total"], "failed": totals["errored"] + totals["incomplete"],
            "ttft_ms": m["time_to_first_token_ms"]["successful"]["percentiles"]["p50"],
            "itl_ms": m["inter_token_latency_ms"]["successful"]["percentiles"]["p50"],
            "output_tokens": m["output_token_count"]["successful"]["total_sum"], "wall_s": bench["duration"]}


def read_aiperf(out: Path) -> dict:
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    failed = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    return {"requests": int(d["request_count"]["avg"]) + failed, "failed": failed,
            "ttft_ms": d["time_to_first_token"]["p50"], "itl_ms": d["inter_token_latency"]["p50"],
            "output_tokens": d["total_output_tokens"]["avg"], "wall_s": d["benchmark_duration"]["avg"]}


def exact_prompts(seed: int, n: int, tokens: int, model: str | None) -> list[str]:
    """``n`` prompts of exactly ``tokens`` tokens of the served model's tokenizer, as the tools' synthetic
    prompts are (bench serve's ``prompts`` run about 1.3 tokens a word, so a word count misses by ~10%)."""
    from tokenizers import Tokenizer

    from services.engine.model_source import model_card
    from services.gateway.bench import prompts

    tokenizer = Tokenizer.from_file(str(Path(model_card(model).tokenizer_dir) / "tokenizer.json"))
    out = []
    for i, text in enumerate(prompts(seed, n, tokens)):  # a word is at least one token: long enough
        head, words = text.split(" ", 2)[:2], text.split(" ")[2:]
        while words and len(tokenizer.encode(" ".join([*head, *words]), add_special_tokens=False).ids) > tokens:
            words.pop()
        out.append(" ".join([*head, *words]))
    return out


async def pdserve_block(url: str, model: str, args, seed: int) -> dict:
    """pdserve's own generator (the one every serving bench shares) on the same load."""
    from urllib.parse import urlsplit

    from services.bench.load import OpenAIClient, OpenAIRequest, open_loop

    where = urlsplit(url)
    client = OpenAIClient(where.hostname, where.port, model)
    items = [OpenAIRequest("completion", p, args.output_tokens, extra={"ignore_eos": True})
             for p in exact_prompts(seed, args.requests, args.prompt_tokens, getattr(args, "model", None))]
    cpu = time.process_time()
    samples, wall = await open_loop(client.send, items, args.rate, seed, poisson=args.arrivals == "poisson")
    cpu = time.process_time() - cpu
    ok = [s for s in samples if s.ok]
    itl = [v for v in map(time_per_output_token, ok) if v is not None]
    return {"requests": len(samples), "failed": len(samples) - len(ok),
            "ttft_ms": pct([s.ttft for s in ok], 50) * 1e3, "itl_ms": pct(itl, 50) * 1e3,
            "chunk_gap_ms": pct([g for s in ok for g in s.gaps], 50) * 1e3,
            "output_tokens": sum(s.tokens for s in ok), "wall_s": wall, "client_cpu_s": round(cpu, 2)}


def run_block(tool: str, url: str, model: str, tokenizer: str, cache: Path, args, seed: int) -> dict:
    if tool == "pdserve":
        return asyncio.run(pdserve_block(url, model, args, seed))
    with tempfile.TemporaryDirectory(prefix=f"pdserve-{tool}-") as tmp:
        out = Path(tmp) / ("guidellm.json" if tool == "guidellm" else "aiperf")
        cmd = guidellm_command(url, model, tokenizer, args, out) if tool == "guidellm" \
            else aiperf_command(url, model, tokenizer, args, out, seed)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(cmd, env=offline_env(cache), cwd=tmp, capture_output=True, text=True,
                              timeout=args.tool_timeout)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        got = read_guidellm(out) if tool == "guidellm" else read_aiperf(out)
        # the tool's own CPU time (all its processes, start-up included): what it takes from the stack it measures
        got["client_cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)
        return got


def _pooled(blocks: list[dict]) -> dict:
    """Two blocks of one tool as one: latencies by the mean of the blocks' medians, throughput pooled."""
    tokens, wall = sum(b["output_tokens"] for b in blocks), sum(b["wall_s"] for b in blocks)
    return {"requests": sum(b["requests"] for b in blocks), "failed": sum(b["failed"] for b in blocks),
            "ttft_ms_p50": sum(b["ttft_ms"] for b in blocks) / len(blocks),
            "itl_ms_p50": sum(b["itl_ms"] for b in blocks) / len(blocks),
            "output_tok_s": tokens / wall if wall else 0.0,
            "client_cpu_s": sum(b.get("client_cpu_s", 0.0) for b in blocks), "blocks": blocks}


def measure(stack_url: str, model: str, args) -> dict:
    cache, tokenizer = tokenizer_cache(args.model)
    blocks: dict[str, list[dict]] = {}
    for i, tool in enumerate(_ORDER):
        if tool not in args.tools and tool != "pdserve":
            continue
        _log(f"block {i + 1}/{len(_ORDER)}: {tool}, {args.requests} requests at {args.rate:g}/s")
        seed = args.seed + len(blocks.get(tool, ()))  # a tool's two blocks: two arrival schedules, same for all
        blocks.setdefault(tool, []).append(run_block(tool, stack_url, model, tokenizer, cache, args, seed))
    pooled = {tool: _pooled(b) for tool, b in blocks.items()}
    base = pooled["pdserve"]
    for tool, row in pooled.items():
        if tool != "pdserve":
            row["vs_pdserve"] = {key: ratio(row[key], base[key]) for key in ("ttft_ms_p50", "itl_ms_p50",
                                                                             "output_tok_s")}
    home = str(Path.home())  # the commands as a user would copy them, without this machine's home directory
    return {"tools": pooled, "commands": {
        "guidellm": " ".join([*(f"{k}={v}" for k, v in GUIDELLM_ENV.items()),
                              *guidellm_command("http://127.0.0.1:8000", model, tokenizer, args,
                                                Path("out.json"))]).replace(home, "~"),
        "aiperf": " ".join(aiperf_command("http://127.0.0.1:8000", model, tokenizer, args, Path("aiperf-out"),
                                          args.seed)).replace(home, "~")},
        "config": {"rate": args.rate, "arrivals": args.arrivals, "requests_per_block": args.requests,
                   "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "order": list(_ORDER), "dtype": args.dtype,
                   "versions": dict(TOOLS)}}


def run(args) -> int:
    from services.launcher import LocalStack, StackSpec

    if args.rate <= 0 or args.requests < 1 or args.output_tokens < 2 or args.prompt_tokens < 1:
        raise ValueError("rate, requests and prompt tokens must be positive, output tokens at least 2")
    ensure_tools(args.tools)
    spec = StackSpec(prefill=1, decode=1, model=args.model, dtype=args.dtype, threads=args.threads, gateway=True)
    _log("starting the stack (embedded Redis, 1 prefill, 1 decode, router, gateway)")
    with LocalStack(spec) as stack:
        url = f"http://{stack.gateway_address}"
        import httpx

        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        result = measure(url, model, args)
    result_files.save("loadtools", result, args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(f"{'tool':>9} {'requests':>8} {'failed':>6} {'TTFT p50 ms':>11} {'ITL p50 ms':>10} {'out tok/s':>9} "
          f"{'client CPU s':>12}   vs pdserve (TTFT / ITL / tok/s)")
    for tool, r in result["tools"].items():
        vs = r.get("vs_pdserve")
        ratios = " / ".join(f"{vs[k]:.3f}" if vs[k] is not None else "-" for k in vs) if vs else ""
        print(f"{tool:>9} {r['requests']:>8} {r['failed']:>6} {r['ttft_ms_p50']:>11.1f} {r['itl_ms_p50']:>10.1f} "
              f"{r['output_tok_s']:>9.1f} {r.get('client_cpu_s', 0.0):>12.1f}   {ratios}")


def _log(msg: str) -> None:
    print(f"[bench loadtools] {msg}", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("loadtools", help="guidellm and aiperf against the stack beside pdserve's own load",
                       description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rate", type=float, default=1.0, help="arrival rate, requests/s")
    p.add_argument("--arrivals", default="constant", choices=["constant", "poisson"],
                   help="constant: evenly spaced, the same schedule for every tool")
    p.add_argument("--requests", type=int, default=20, help="requests per block (each tool runs two blocks)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=list(TOOLS))
    p.add_argument("--tool-timeout", type=float, default=900.0, help="seconds one tool run may take")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m services.bench.loadtools install   (guidellm and aiperf, each in its own venv)")
    ensure_tools()
    cache, repo = tokenizer_cache(None)
    print(f"tools in {tools_dir()}; the default model's tokenizer as {repo} in {cache} (HF_HUB_CACHE)")
