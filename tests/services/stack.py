"""Real pdserve processes for tests: workers and a router on loopback, against a real Redis.

    with Stack(redis_url, prefill=2, decode=1) as stack:
        stack.generate(text="...")            # through the router's public gRPC API
        stack.kill("prefill-0")               # SIGKILL one process
        stack.load("decode-0")                # GetLoad of a worker (the leak check)
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import redis as redis_lib

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc

_READY = re.compile(r"\[pdserve\] (?:\w+ worker (\S+) )?.*?ready on (\S+)(?: \(.*metrics ([^)\s]+)\))?")


class Proc:
    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.address = self.worker_id = self.metrics = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = _READY.search(line)
            if m and not self.ready.is_set():
                self.worker_id, self.address, self.metrics = m.group(1), m.group(2), m.group(3)
                self.ready.set()

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n" + "\n".join(self.lines[-30:]))

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def output(self) -> str:
        return "\n".join(self.lines)


async def worker_load(name: str, address: str) -> worker_pb2.WorkerLoad:
    """GetLoad of the worker ``name`` (``prefill-*`` or ``decode-*``) at ``address``."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = (worker_pb2_grpc.PrefillWorkerStub if name.startswith("prefill") else worker_pb2_grpc.DecodeWorkerStub)(ch)
        return await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


async def until(condition, timeout_s: float = 10) -> bool:
    """Whether ``await condition()`` came true within ``timeout_s`` (asked every 10 ms)."""
    async def poll():
        while not await condition():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        return False
    return True


def wait_idle(workers: dict[str, str], timeout_s: float = 30) -> dict[str, int]:
    """KV blocks still in use per worker (name -> address) once nothing runs: 0 everywhere is no leak."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {n: asyncio.run(worker_load(n, a)).kv_blocks_used for n, a in workers.items()}
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def live_workers(procs: dict) -> dict[str, str]:
    """name -> address of the stack's worker processes still running (a Stack's or a LocalStack's)."""
    return {n: p.address for n, p in procs.items()
            if n.startswith(("prefill", "decode")) and p.proc is not None and p.proc.poll() is None}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


class Stack:
    def __init__(self, redis_url: str, prefill: int = 1, decode: int = 1, dtype: str = "fp32",
                 router_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                 decode_args: tuple[str, ...] = ()):
        redis_lib.Redis.from_url(redis_url).flushdb()  # a fresh registry and KV-event stream
        self.redis_url = redis_url
        common = ["--redis-url", redis_url, "--dtype", dtype, "--threads", "1", "--kv-cache-gb", "0.25",
                  "--max-num-batched-tokens", "256", "--long-prefill-chunk", "128", *worker_args]
        self.procs: dict[str, Proc] = {}
        for i in range(prefill):
            self.procs[f"prefill-{i}"] = Proc(f"prefill-{i}", _cli("prefill", *common))
        for i in range(decode):
            self.procs[f"decode-{i}"] = Proc(f"decode-{i}", _cli("decode", *common, *decode_args))
        try:
            for p in self.procs.values():
                p.wait_ready()
            self.procs["router"] = Proc("router", _cli("router", "--redis-url", redis_url, "--port", "0",
                                                       *router_args))
            self.procs["router"].wait_ready()
            self.wait_for_workers(prefill, decode)
        except BaseException:
            self.close()
            raise
        self.address = self.procs["router"].address

    def wait_for_workers(self, prefill: int, decode: int, timeout_s: float = 20) -> None:
        """Until the router's registry view shows this many workers (it refreshes every 0.25 s)."""
        from services.registry import read_workers
        import redis.asyncio as aioredis

        async def count():
            r = aioredis.Redis.from_url(self.redis_url)
            try:
                ws = await read_workers(r)
            finally:
                await r.aclose()
            return sum(w.role == "prefill" for w in ws), sum(w.role == "decode" for w in ws)

        deadline = time.monotonic() + timeout_s
        while asyncio.run(count()) != (prefill, decode):
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not register: {asyncio.run(count())}")
            time.sleep(0.2)
        time.sleep(0.6)  # the router's pool refresh

    # ---- calls ------------------------------------------------------------
    def request(self, text: str | None = None, token_ids: list[int] | None = None, chat: str | None = None,
                max_tokens: int = 8, **sampling) -> generate_pb2.GenerateRequest:
        sampling = {"temperature": 0.0, **sampling}
        req = generate_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
        if text is not None:
            req.text = text
        elif token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        elif chat is not None:
            req.chat.messages.append(generate_pb2.ChatMessage(role="user", content=chat))
        return req

    async def agenerate(self, req: generate_pb2.GenerateRequest, timeout_s: float = 120):
        """(token ids, text, Finish) of one request; raises grpc.aio.AioRpcError on failure."""
        async with grpc.aio.insecure_channel(self.address) as ch:
            ids, text, finish = [], "", None
            async for msg in generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout_s):
                if msg.HasField("chunk"):
                    ids.extend(msg.chunk.token_ids)
                    text += msg.chunk.text
                else:
                    finish = msg.finish
            return ids, text, finish

    def generate(self, req: generate_pb2.GenerateRequest, timeout_s: float = 120):
        return asyncio.run(self.agenerate(req, timeout_s))

    async def aload(self, name: str) -> worker_pb2.WorkerLoad:
        return await worker_load(name, self.procs[name].address)

    def load(self, name: str) -> worker_pb2.WorkerLoad:
        return asyncio.run(self.aload(name))

    def wait_idle(self, names: list[str], timeout_s: float = 30) -> dict[str, int]:
        """Blocks still in use per worker once nothing runs (0 everywhere = no leak)."""
        return wait_idle({n: self.procs[n].address for n in names}, timeout_s)

    def metrics(self, name: str) -> str:
        address = self.procs[name].metrics
        return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].signal(sig)

    def close(self) -> None:
        for p in self.procs.values():
            p.signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:
                p.signal(signal.SIGKILL)
                p.proc.wait()

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
