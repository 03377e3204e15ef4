"""The faults of ``pdserve bench chaos``, one per scenario, and reading the stack's state around them.

Each fault is a coroutine ``fault(ctx)`` that runs while the scenario's requests
are in flight; it waits until the load is under way (``ctx.sending_for``), does
its harm, and sets ``ctx.fault_at`` (time.monotonic()) to the moment from which
recovery is measured. Killed processes are started again by the bench's
``Supervisor``, as ``pdserve up`` does.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field

import grpc
import httpx

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.launcher import LocalStack


@dataclass
class FaultContext:
    stack: LocalStack
    gateway_url: str  # http://host:port/v1
    model: str
    load_s: float  # how long the scenario's requests take to send
    stall_s: float = 15.0
    fault_at: float | None = None
    bad_input_5xx: int = 0
    bad_input: list[tuple[str, int]] = field(default_factory=list)  # (case, status) of every malformed request

    async def sending_for(self, share: float) -> None:
        """Wait until this share of the scenario's sending time has passed (streams are open by then)."""
        await asyncio.sleep(self.load_s * share)


def _kill(name: str):
    async def fault(ctx: FaultContext) -> None:
        await ctx.sending_for(0.35)
        ctx.stack.procs[name].signal(signal.SIGKILL)
        ctx.fault_at = time.monotonic()
    return fault


async def redis_restart(ctx: FaultContext) -> None:
    await ctx.sending_for(0.35)
    ctx.fault_at = time.monotonic()
    await asyncio.to_thread(ctx.stack.restart_redis, 2.0)


async def worker_stall(ctx: FaultContext) -> None:
    await ctx.sending_for(0.25)
    victim = ctx.stack.procs["decode-0"]
    victim.signal(signal.SIGSTOP)
    ctx.fault_at = time.monotonic()
    try:
        await asyncio.sleep(ctx.stall_s)
    finally:
        victim.signal(signal.SIGCONT)


STALL_FACTOR = 1.5  # a timed-out transfer's finish is held back this many times it (30 s at bench chaos's default --transfer-timeout, 20 s)


async def transfer_fault(ctx: FaultContext) -> None:
    """Both prefill workers and the first decode worker restarted with PDSERVE_KV_FAULTS
    (kvtransfer/faults.py) before the load: the prefill workers' 2nd and 4th transfers time out,
    and the 1st and 3rd chunks the decode worker takes in land corrupted."""
    ctx.fault_at = time.monotonic()


def _fault_spec(name: str) -> str | None:
    """What a restarted worker injects: a sender (prefill) times out, a receiver (decode) corrupts."""
    if name.startswith("prefill"):
        return "timeout:2,timeout:4"
    return "corrupt:1,corrupt:3" if name == "decode-0" else None


def arm_transfer_faults(stack: LocalStack, transfer_timeout_s: float) -> list[str]:
    """Restart the chosen workers with the fault-injection setting on (the supervisor starts them again); a
    transfer chosen to time out holds its finish back past the router's ``transfer_timeout_s``."""
    stall_s = transfer_timeout_s * STALL_FACTOR
    names = []
    for name, p in stack.procs.items():
        spec = _fault_spec(name)
        if spec is None:
            continue
        p.env = {**(p.env or {}), "PDSERVE_KV_FAULTS": spec, "PDSERVE_KV_FAULT_STALL_S": f"{stall_s:g}"}
        p.signal(signal.SIGTERM)
        names.append(name)
    return names


async def at_start(ctx: FaultContext) -> None:
    """Scenarios whose fault is in the requests themselves (client-disconnect, overload)."""
    ctx.fault_at = time.monotonic()


# Malformed requests of every kind the gateway must refuse with a 4xx (never a 5xx, a hang or a crash).
def _bad_requests(model: str) -> list[tuple[str, str, str, dict, bytes]]:
    chat, json_type = "/chat/completions", {"content-type": "application/json"}
    msgs = [{"role": "user", "content": "hi"}]

    def body(**kw) -> bytes:
        return json.dumps({"model": model, "messages": msgs, **kw}).encode()

    return [
        ("not JSON", "POST", chat, json_type, b"{not json"),
        ("invalid UTF-8", "POST", chat, json_type, b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ("JSON array", "POST", chat, json_type, b"[1, 2, 3]"),
        ("no messages", "POST", chat, json_type, body(messages=[])),
        ("messages not a list", "POST", chat, json_type, body(messages="hello")),
        ("negative max_tokens", "POST", chat, json_type, body(max_tokens=-5)),
        ("huge max_tokens", "POST", chat, json_type, body(max_tokens=10**12)),
        ("temperature a string", "POST", chat, json_type, body(temperature="hot")),
        ("top_p out of range", "POST", chat, json_type, body(top_p=7.5)),
        ("unknown model", "POST", chat, json_type, body(model="no-such-model")),
        ("unknown role", "POST", chat, json_type, body(messages=[{"role": "wizard", "content": "hi"}])),
        ("n = 0", "POST", chat, json_type, body(n=0)),
        ("prompt over the context", "POST", "/completions", json_type,
         json.dumps({"model": model, "prompt": "word " * 40_000}).encode()),
        ("body over the size cap", "POST", chat, json_type, b'{"pad": "' + b"x" * (2 << 20) + b'"}'),
        ("unknown priority tier", "POST", chat, {**json_type, "x-pdserve-priority": "platinum"}, body()),
        ("bad timeout header", "POST", chat, {**json_type, "x-pdserve-timeout": "-1"}, body()),
        ("bad Last-Event-ID", "GET", "/requests/nope/events", {"last-event-id": "x" * 300}, b""),
        ("unknown request", "GET", "/requests/does-not-exist/events", {}, b""),
        ("wrong content type", "POST", chat, {"content-type": "text/plain"}, b"hello"),
        ("logprobs a number", "POST", chat, json_type, body(logprobs=3, top_logprobs=-1)),
    ]


async def bad_input(ctx: FaultContext) -> None:
    """The malformed requests, sent over and over while the scenario's normal requests run."""
    ctx.fault_at = time.monotonic()
    cases = _bad_requests(ctx.model)
    end = time.monotonic() + ctx.load_s
    async with httpx.AsyncClient(base_url=ctx.gateway_url, timeout=60) as http:
        while time.monotonic() < end:
            for case, method, path, headers, content in cases:
                try:
                    r = await http.request(method, path, headers=headers, content=content)
                    status = r.status_code
                    if status >= 500 or (400 <= status < 500 and "error" not in r.json()):
                        ctx.bad_input_5xx += status >= 500
                except (httpx.HTTPError, ValueError):
                    status = 0  # no answer, or not the JSON error body: counted as lost
                ctx.bad_input.append((case, status))
            await asyncio.sleep(1.0)


FAULTS = {
    "decode-kill": _kill("decode-0"),
    "prefill-kill": _kill("prefill-0"),
    "router-kill": _kill("router"),
    "redis-restart": redis_restart,
    "worker-stall": worker_stall,
    "overload": at_start,
    "client-disconnect": at_start,
    "bad-input": bad_input,
    "transfer-fault": transfer_fault,
}


async def blocks_in_use(stack: LocalStack) -> dict[str, int]:
    """KV blocks in use on every worker (GetLoad); a worker that does not answer is -1."""
    async def one(name: str) -> int:
        p = stack.procs[name]
        try:
            async with grpc.aio.insecure_channel(p.address) as ch:
                stub = (worker_pb2_grpc.PrefillWorkerStub if name.startswith("prefill")
                        else worker_pb2_grpc.DecodeWorkerStub)(ch)
                return (await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)).kv_blocks_used
        except grpc.aio.AioRpcError:
            return -1

    names = [n for n in stack.procs if n.startswith(("prefill", "decode"))]
    return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))


async def wait_idle(stack: LocalStack, timeout_s: float) -> tuple[dict[str, int], float]:
    """Blocks still in use per worker once nothing runs (0 everywhere: no leak), and how long that took."""
    start = time.monotonic()
    while True:
        used = await blocks_in_use(stack)
        if not any(used.values()) or time.monotonic() - start > timeout_s:
            return used, time.monotonic() - start
        await asyncio.sleep(0.5)


async def wait_healthy(stack: LocalStack, timeout_s: float) -> None:
    """Until every process is running and ready again (the supervisor restarts the dead)."""
    deadline = time.monotonic() + timeout_s
    while not all(p.alive() and p.ready.is_set() for p in stack.procs.values()):
        if time.monotonic() > deadline:
            raise TimeoutError("the stack did not recover: " + ", ".join(
                p.name for p in stack.procs.values() if not (p.alive() and p.ready.is_set())))
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.5)  # the router's registry refresh, the workers' first heartbeat
