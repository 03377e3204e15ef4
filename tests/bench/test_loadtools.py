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

@pytest.fixture(scope="module")
def stack(redis_url):
    loadtools.ensure_tools()
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url)
    with LocalStack(spec) as s:
        yield s


@pytest.mark.slow
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


def test_pdserve_prompts_have_exactly_the_tools_token_count():
    from tokenizers import Tokenizer

    from services.engine.model_source import model_card

    tokenizer = Tokenizer.from_file(f"{model_card(None).tokenizer_dir}/tokenizer.json")
    for tokens in (16, 64, 200):
        got = loadtools.exact_prompts(0, 5, tokens, None)
        assert len(set(got)) == 5
        assert [len(tokenizer.encode(p, add_special_tokens=False).ids) for p in got] == [tokens] * 5


def test_inter_token_latency_is_the_tools_per_request_mean_not_the_median_gap():
    from services.bench.load import Sample
    from services.bench.stats import time_per_output_token

    # 5 tokens delivered as a burst: two chunks at once, then 90 ms, twice (a median gap of 0)
    bursty = Sample(True, ttft=0.1, gaps=[0.0, 0.09, 0.0, 0.09], tokens=5)
    assert time_per_output_token(bursty) == pytest.approx(0.045)
    assert time_per_output_token(Sample(True, ttft=0.1, gaps=[], tokens=1)) is None
