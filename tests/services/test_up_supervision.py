"""`pdserve up` supervises its children: a decode worker killed mid-stream is restarted (said on the console)
and the streams it held finish on the other one, with nothing lost."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.services.test_up import _free_port, ctrl_c, start_up

pytestmark = pytest.mark.slow


def _stream(port: int, prompt: str, max_tokens: int) -> tuple[str, bool, str]:
    """(text, ended with [DONE], error) of one streamed chat completion."""
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}
    text, done, error = "", False, ""
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and '"error"' in line:
                error = line
            elif line.startswith("data: "):
                choices = json.loads(line[6:]).get("choices") or [{}]
                text += choices[0].get("delta", {}).get("content") or ""
    return text, done, error


def test_a_decode_worker_killed_under_up_is_restarted_and_its_streams_finish():
    http_port, router_port = _free_port(), _free_port()
    proc, lines, up = start_up("--decode", "2", "--policy", "least-load", "--port", str(http_port),
                               "--grpc-port", "-1", "--router-port", str(router_port), "--max-restart-backoff", "2")

    def wait_for(pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, "\n".join(lines), re.MULTILINE)
            if m:
                return m
            assert proc.poll() is None, "\n".join(lines[-40:])
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(lines[-40:]))

    try:
        assert up.wait(240), "\n".join(lines[-40:])
        victim = int(wait_for(r"^  decode-0\s+\S+\s+pid (\d+)", 1)[1])
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(_stream, http_port, f"Tell a long story about the number {i}.", 96)
                       for i in range(4)]
            time.sleep(3)  # the streams are running on both decode workers (least-load spreads them)
            os.killpg(victim, signal.SIGKILL)
            results = [s.result(timeout=240) for s in streams]
        for text, done, error in results:
            assert done and not error and text, (text, done, error)
        # said on the console, restarted, ready again, and the stack kept running
        wait_for(r"\[pdserve\] decode-0 exited \(status -9\).*restarting it in", 30)
        wait_for(r"\[pdserve\] decode-0 restarted \(pid \d+\)", 30)
        ready = wait_for(r"(?s)decode-0 restarted.*\[decode-0\].*ready on", 240)
        assert ready and proc.poll() is None
        text, done, error = _stream(http_port, "What is the capital of France?", 12)
        assert done and not error and "Paris" in text
    finally:
        rc = ctrl_c(proc)
    assert rc == 0, "\n".join(lines[-40:])
