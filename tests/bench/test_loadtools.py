"""guidellm and aiperf, installed in their own virtualenvs, run against the stack offline (a few seconds of load).

What a user would see: each tool completes every request with no error, reads the
served model's tokenizer without a hub, and reports TTFT, inter-token latency and
output throughput; the output is exactly the requested tokens (ignore_eos honoured).
"""

from __future__ import annotations

import argparse

import pytest
import redis

from services.bench import loadtools
from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url):
    loadtools.ensure_tools()
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url)
    with LocalStack(spec) as s:
        yield s


@pytest.mark.parametrize("tool", ["pdserve", "guidellm", "aiperf"])
def test_each_tool_runs_offline_and_reports_the_metrics(stack, tool):
    args = argparse.Namespace(rate=4.0, arrivals="constant", requests=3, prompt_tokens=32, output_tokens=6,
                              tool_timeout=600, seed=0)
    cache, tokenizer = loadtools.tokenizer_cache(None)
    url = f"http://{stack.gateway_address}"
    got = loadtools.run_block(tool, url, "SmolLM2-135M-Instruct", tokenizer, cache, args, seed=0)
    assert got["requests"] == 3 and got["failed"] == 0, got
    assert got["output_tokens"] == 3 * 6, got  # every request ran to exactly output_tokens
    assert got["ttft_ms"] > 0 and got["itl_ms"] > 0 and got["wall_s"] > 0, got
