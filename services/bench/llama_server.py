"""llama.cpp's ``llama-server`` as a benchmark baseline: where the binary is, how to get it, one running server.

    binary = find(args.llama_server)            # None: not built; HOW_TO_GET says how
    with LlamaServer(binary, gguf, parallel=16, threads=2) as server:
        server.port                             # OpenAI-compatible HTTP on 127.0.0.1

The binary is looked up in this order: the path given (``--llama-server``),
``$PDSERVE_LLAMA_SERVER``, what ``scripts/build_llama_server.sh`` caches
(``~/.cache/pdserve/llama-server/<version>/llama-server``, or under
``$PDSERVE_LLAMA_SERVER_DIR``), then ``llama-server`` on ``PATH``. The server
runs with continuous batching over ``parallel`` slots, each with its own prompt
cache (llama-server's defaults), and ``ctx_per_slot`` tokens of context each.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HOW_TO_GET = ("llama-server was not found: build it from llama.cpp's source with `bash scripts/build_llama_server.sh` "
              "(about 6 minutes on 2 cores; cached under ~/.cache/pdserve/llama-server/), or pass "
              "--llama-server PATH (or set PDSERVE_LLAMA_SERVER)")


class LlamaServerError(RuntimeError):
    """llama-server could not start or was not ready in time; the message has its last output lines."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode  # the exit status when it exited (-11: SIGSEGV), None when it hung


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_LLAMA_SERVER_DIR") or Path.home() / ".cache" / "pdserve" / "llama-server")


def find(given: str | None = None) -> Path | None:
    """The llama-server binary to run, or None. A path given explicitly must exist (ValueError otherwise)."""
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"--llama-server {given}: not an executable file")
        return path
    env = os.environ.get("PDSERVE_LLAMA_SERVER")
    if env:
        return find(env)
    built = sorted(cache_root().glob("*/llama-server"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in built:
        if os.access(path, os.X_OK):
            return path
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0].split(":", 1)[1].strip() if lines else "unknown"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, parallel: int, threads: int, ctx_per_slot: int = 1024,
                 batch: int | None = None, host: str = "127.0.0.1", extra: list[str] | None = None):
        if parallel < 1 or threads < 1 or ctx_per_slot < 64:
            raise ValueError("llama-server needs parallel >= 1, threads >= 1 and ctx_per_slot >= 64")
        self.binary, self.gguf, self.host = binary, gguf, host
        self.parallel, self.threads, self.batch = parallel, threads, batch
        self.argv = [str(binary), "-m", str(gguf), "--host", host, "--port", "0", "-np", str(parallel),
                     "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
                     "--cont-batching", "--no-webui", *(["-b", str(batch)] if batch else []), *(extra or [])]
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []

    def start(self, timeout_s: float = 120.0) -> None:
        self.log = []
        self.port = _free_port(self.host)
        self.argv[self.argv.index("--port") + 1] = str(self.port)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._pump, daemon=True, name="out-llama-server").start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited (status {self.proc.returncode}):\n  "
                                       + "\n  ".join(self.log[-20:]), self.proc.returncode)
            try:
                with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise LlamaServerError(f"llama-server was not ready after {timeout_s:.0f} s:\n  " + "\n  ".join(self.log[-20:]))

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log = (self.log + [line.rstrip("\n")])[-200:]

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def describe(self) -> str:
        return " ".join(["llama-server -np", str(self.parallel), "-t", str(self.threads),
                         *(["-b", str(self.batch)] if self.batch else []), *self.argv[self.argv.index("--no-webui") + 1:]])

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
