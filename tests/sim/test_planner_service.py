"""``pdserve planner`` for real: signals from a real Redis (registry, admission queue) and real
Prometheus endpoints, decisions published to Redis and /metrics, local workers started and drained."""

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis as redis_lib
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from services.planner.policy import Capacity, Planner, PlannerConfig
from services.planner.service import EmitActuator, run_loop
from services.planner.signals import SignalReader, attainment, scrape
from services.queue.admission import AdmissionQueue
from services.queue.message import QueuedRequest
from services.registry import WORKERS_KEY, WorkerInfo, connect_redis, worker_key


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _worker_metrics():
    """A worker's metric families in their own registry, served over real HTTP (the ones pdserve exports)."""
    reg = CollectorRegistry()
    m = {
        "queries": Counter("pdserve_prefix_cache_queries", "", ["role", "worker"], registry=reg),
        "hits": Counter("pdserve_prefix_cache_hits", "", ["role", "worker"], registry=reg),
        "ttft": Histogram("pdserve_ttft_seconds", "", ["role"], registry=reg,
                          buckets=(0.5, 1.0, 2.5, 5.0)),
        "itl": Histogram("pdserve_inter_token_latency_seconds", "", ["role"], registry=reg,
                         buckets=(0.05, 0.1, 0.25)),
    }
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    return m, f"127.0.0.1:{server.server_port}", server


def test_attainment_reads_the_window_at_the_slo_bucket():
    m, address, server = _worker_metrics()
    try:
        for s in (0.2, 0.7, 3.0):
            m["ttft"].labels(role="prefill").observe(s)
        before = scrape(address)
        for s in (0.2, 0.3, 0.9, 2.0, 4.0):  # the window: 4 of 5 within 2.5 s
            m["ttft"].labels(role="prefill").observe(s)
        after = scrape(address)
        assert attainment(before, after, "pdserve_ttft_seconds", "prefill", 2.5) == (0.8, 5)
        assert attainment(before, after, "pdserve_ttft_seconds", "prefill", 1.0) == (0.6, 5)
        assert attainment(after, after, "pdserve_ttft_seconds", "prefill", 2.5) == (None, 0)
    finally:
        server.shutdown()


def _register(r, worker_id, role, metrics="", kv_used=0, kv_total=1000, running=0, draining=False):
    info = WorkerInfo(worker_id=worker_id, role=role, address="127.0.0.1:1", model="m", namespace="ns",
                      block_size=16, max_model_len=2048, metrics_address=metrics, ready=True, draining=draining,
                      num_running=running, kv_blocks_total=kv_total, kv_blocks_used=kv_used)
    r.set(worker_key(worker_id), info.to_json(), px=60_000)
    r.sadd(WORKERS_KEY, worker_id)


def test_one_tick_reads_redis_and_metrics_and_publishes_the_decision(redis_url):
    r = redis_lib.Redis.from_url(redis_url)
    r.flushdb()
    m, address, server = _worker_metrics()
    _register(r, "p0", "prefill", metrics=address)
    _register(r, "d0", "decode", kv_used=1900, running=30)  # 1.9 caches of 1000 blocks in use
    _register(r, "d1", "decode", kv_used=0, draining=True)  # leaving: not counted
    clock = FakeClock()

    async def go():
        redis = await connect_redis(redis_url)
        queue = AdmissionQueue(redis)
        for i in range(3):  # 3 x 4000 prompt tokens waiting
            await queue.enqueue(QueuedRequest(f"r{i}", "t", "standard", "m", [1] * 4000))
        reader = SignalReader(redis, model="m", ttft_slo_s=2.5, clock=clock)
        planner = Planner(PlannerConfig(target_utilisation=0.5, kv_target=0.5, lag_target_s=1.0, slo_min_requests=1,
                                        slo_sigmas=0),  # 1 late of 3 counts (the judge is tested apart)
                          Capacity(prefill_tokens_per_s=1000, kv_blocks=1000, max_num_seqs=100))
        out = io.StringIO()
        actuator = EmitActuator(redis, "m", out=out)
        first = await reader.read()  # opens the metrics window
        m["queries"].labels(role="prefill", worker="p0").inc(500)  # 500 blocks looked up, 250 hit:
        m["hits"].labels(role="prefill", worker="p0").inc(250)  # 250 x 16 = 4000 tokens computed
        for s in (0.3, 0.4, 9.0):
            m["ttft"].labels(role="prefill").observe(s)
        clock.t += 2.0  # over 2 s: 2000 tokens/s
        records = await run_loop(reader, planner, actuator, interval_s=0.01, ticks=1)
        await redis.aclose()
        return first, records, out.getvalue()

    try:
        first, records, printed = asyncio.run(go())
    finally:
        server.shutdown()
    s = first.signals
    assert (s.prefill_workers, s.decode_workers) == (1, 1)
    assert s.queued_prefill_tokens == 12_000 and s.kv_blocks_used == 1900
    rec = records[0]
    # 12 s of queued prefill work on one worker: the ready one plus ceil(12 / 1) to clear it in 1 s (demand's 4
    # are among them)
    assert rec["prefill"] == 1 + 12 and "queue lag" in rec["reason"]
    assert "TTFT attainment 0.667" in rec["reason"]
    assert rec["decode"] == 4  # 1900 / (1000 * 0.5)
    assert json.loads(printed.strip()) == rec
    stored = {k.decode(): v.decode() for k, v in r.hgetall("pd:planner:m").items()}
    assert (stored["prefill"], stored["decode"]) == ("13", "4")


def test_cli_rejects_bad_flags():
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "services.cli", "planner", "--interval", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--interval must be > 0" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "services.cli", "planner", "--target-utilisation", "1.5",
                           "--redis-url", "redis://127.0.0.1:1/0"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "target_utilisation must be in (0, 1]" in proc.stderr


@pytest.mark.slow
def test_local_actuation_starts_a_decode_worker_and_drains_it_on_exit(redis_url):
    """An empty cluster and min_decode 1: the planner starts a real decode worker, which registers;
    stopping the planner drains it (it deregisters and exits)."""
    r = redis_lib.Redis.from_url(redis_url)
    r.flushdb()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "planner", "--redis-url", redis_url,
                             "--actuate", "local", "--interval", "1", "--metrics-port", "-1",
                             "--worker-args", "--kv-cache-gb 0.25 --threads 1 --port 0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ids = [m.decode() for m in r.smembers(WORKERS_KEY)]
            if any(i.startswith("decode") for i in ids):
                break
            time.sleep(0.5)
        else:
            pytest.fail("no decode worker registered")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        lines = out.splitlines()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    decisions = [json.loads(line) for line in lines if line.startswith("{")]
    assert decisions and decisions[0]["decode"] == 1 and decisions[0]["local_decode"] == 1
    assert proc.returncode == 0
    assert not [m for m in r.smembers(WORKERS_KEY) if r.exists(worker_key(m.decode()))]
