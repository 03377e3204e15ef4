"""``pdserve profile`` and the gateway's POST /admin/profile against a real stack with requests running.

One stack (1 prefill + 1 decode worker, router, gateway; --enable-profiling) and a client
thread sending completions through the gateway while the profile records. Workers record
without Python stacks (--no-stack) to keep the test's traces small; the stacks path is the
torch profiler's own option, shown by the manual run in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import redis

from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url,
                     transport="tcp", profiling=True)
    with LocalStack(spec) as s:
        yield s


class _Sent(list):
    """The trace ids sent, and each request's (seconds, HTTP status or error): what a failure prints."""

    def __init__(self):
        super().__init__()
        self.outcomes: list[tuple[float, str]] = []


@contextmanager
def traffic(stack):
    """Completions through the gateway, one after another, until the block ends; each in a trace of its own
    that the client started (a ``traceparent`` header), whose ids the block yields as they are sent."""
    stop = threading.Event()
    sent = _Sent()

    def send():
        with httpx.Client(base_url=f"http://{stack.gateway_address}", timeout=60) as client:
            while not stop.is_set():
                trace_id = os.urandom(16).hex()
                sent.append(trace_id)
                started = time.monotonic()
                try:
                    reply = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8},
                                        headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
                    outcome = str(reply.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                sent.outcomes.append((round(time.monotonic() - started, 2), outcome))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield sent
    finally:
        stop.set()
        thread.join(60)


def check_chrome_trace(events: list[dict]) -> None:
    """What Perfetto's JSON importer needs: known phases, numeric times, complete events with a
    duration, and every async begin closed by an end of the same (cat, id)."""
    opened = {}
    for e in events:
        assert e["ph"] in ("X", "M", "b", "e", "i", "I", "s", "f", "C"), e
        assert isinstance(e["pid"], int), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] in ("b", "e"):
            key = (e["cat"], e["id"])
            opened[key] = opened.get(key, 0) + (1 if e["ph"] == "b" else -1)
    assert all(v == 0 for v in opened.values())


def _spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") == "span" and e.get("ph") == "b"]


def _record(stack, out):
    """`pdserve profile` for 5 s under traffic: (the requests sent, role -> that process's trace events)."""
    with traffic(stack) as sent:
        done = subprocess.run([sys.executable, "-m", "services.cli", "profile", "--seconds", "5", "--no-stack",
                               "--address", stack.router_address, "--out", str(out)],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(p.name for p in out.iterdir())
    roles = sorted(name.split("-")[0] for name in files if name != "merged.json")
    assert roles == ["decode", "gateway", "prefill", "router"], files
    return sent, {name.split("-")[0]: json.loads((out / name).read_text())["traceEvents"]
                  for name in files if name != "merged.json"}


def test_profile_writes_one_aligned_trace_per_process_and_follows_a_request(stack, tmp_path):
    # Every request in the window goes through the prefill worker: a KV hand-off that failed would serve it by
    # local prefill and hold the prefill worker out for 5 s, the whole window. (CI once saw that: uvloop had
    # made the TCP transport's socket non-blocking under its threads; tests/kvtransfer has the unit test.)
    out = tmp_path / "profile"
    sent, traces = _record(stack, out)
    assert not [line for line in stack.procs["router"].trouble if "attempt" in line], stack.procs["router"].trouble
    roles = sorted(traces)
    for role in roles:
        assert traces[role], role
    # the workers' torch profiler saw engine steps and their aten ops
    ops = {role: sum(e.get("cat") == "cpu_op" for e in traces[role]) for role in ("prefill", "decode")}
    assert any(e.get("name") == "engine.step" for e in traces["decode"]), (ops, sent.outcomes)
    assert ops["prefill"], (ops, sent.outcomes[:5], {name: p.tail(15) for name, p in stack.procs.items()})
    # one request followed across the four processes by its trace id
    by_role = {role: {e["args"]["trace_id"] for e in _spans(traces[role])} for role in roles}
    assert by_role["gateway"] & by_role["router"] & by_role["prefill"] & by_role["decode"]
    # and into the workers' torch ranges: a request the client traced is named on the prefill worker's range
    # around its prompt's forward and on the decode steps it was batched in (their aten ops nest inside)
    ranges = {role: [e["name"] for e in traces[role] if e.get("cat") == "user_annotation"
                     and e["name"].startswith("requests ")] for role in ("prefill", "decode")}
    found = [t for t in sent if any(f"trace_id={t}" in n and "forward_prefill" in n for n in ranges["prefill"])
             and any(f"trace_id={t}" in n and "forward_decode" in n for n in ranges["decode"])]
    assert found, (sent[:3], ranges["prefill"][:3], ranges["decode"][:3])
    # aligned: a request's KV transfer on the decode worker starts after the gateway admitted it
    merged = json.loads((out / "merged.json").read_text())["traceEvents"]
    check_chrome_trace(merged)
    names = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert len(names) == 4
    spans = _spans(merged)
    checked = 0
    for trace_id in by_role["gateway"] & by_role["decode"]:
        admitted = [e["ts"] for e in spans if e["args"]["trace_id"] == trace_id and e["name"] == "gateway.generate"]
        if not admitted:  # admitted before the window opened (its HTTP request's span is in it)
            continue
        transfer = [e["ts"] for e in spans if e["args"]["trace_id"] == trace_id and e["name"] == "kv_transfer"]
        assert all(ts >= min(admitted) for ts in transfer)
        checked += 1
    assert checked
    steps = [e["ts"] for e in merged if e.get("name") == "engine.step"]
    window = max(e["ts"] for e in spans)  # torch's clock moved onto the others': steps inside the window
    assert 0 <= min(steps) and max(steps) <= window + 60e6


def test_idle_stack_gets_a_message_and_no_files(stack, tmp_path):
    out = tmp_path / "idle"
    done = subprocess.run([sys.executable, "-m", "services.cli", "profile", "--seconds", "1", "--no-stack",
                           "--address", stack.router_address, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "nothing to record" in done.stderr
    assert not out.exists()


def test_gateway_endpoint_answers_the_merged_trace(stack):
    with traffic(stack):
        reply = httpx.post(f"http://{stack.gateway_address}/admin/profile", params={"seconds": 2, "stack": "false"},
                           timeout=300)
    assert reply.status_code == 200, reply.text
    merged = reply.json()
    names = sorted(e["args"]["name"].split()[0] for e in merged["traceEvents"] if e.get("name") == "process_name")
    assert names == ["decode", "gateway", "prefill", "router"]
    bad = httpx.post(f"http://{stack.gateway_address}/admin/profile", params={"seconds": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("seconds must be")
