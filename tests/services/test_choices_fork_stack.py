"""``n`` > 1 served as one forked generation, over the real stack with the real model and the openai client:
the prompt computed once for every choice, choices equal to separate requests (the n = 1 requests take the
hand-off: the router disaggregates always), and a decode worker killed mid-stream losing no token of any choice."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import pytest

from services.launcher import LocalStack, StackSpec
from tests.services.stack import worker_load

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
DECODES = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def stack(redis_url):
    spec = StackSpec(prefill=1, decode=2, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url,
                     router_args=["--disaggregation", "always"])
    with LocalStack(spec) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)


def _decode_prompt_tokens(stack) -> float:
    """``pdserve_prompt_tokens_total`` of the decode workers still running: the prompt positions they computed."""
    total = 0.0
    for name in DECODES:
        p = stack.procs[name]
        if not p.alive():
            continue
        text = urllib.request.urlopen(f"http://{p.metrics}/metrics", timeout=10).read().decode()
        total += sum(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("pdserve_prompt_tokens_total{") and 'role="decode"' in line)
    return total


def test_n4_computes_the_prompt_once_and_forks_it_whole(client, stack):
    prompt = "A long account of the harbour, its boats and its storms, told slowly. " * 12
    before = _decode_prompt_tokens(stack)
    r = client.completions.create(model=MODEL, prompt=prompt, n=4, seed=5, temperature=1.0, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    deadline = time.monotonic() + 10
    while _decode_prompt_tokens(stack) - before < r.usage.prompt_tokens and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # a few more stats polls: anything computed twice would show by now
    assert _decode_prompt_tokens(stack) - before == r.usage.prompt_tokens  # once, not 4 times
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 100


def test_seeded_and_greedy_choices_equal_separate_requests_across_the_hand_off(client):
    kw = {"model": MODEL, "prompt": "The old lighthouse keeper said", "max_tokens": 10}
    forked = client.completions.create(n=3, seed=40, temperature=1.0, **kw)
    alone = [client.completions.create(seed=40 + i, temperature=1.0, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in forked.choices] == alone and len(set(alone)) > 1
    greedy = client.completions.create(n=2, temperature=0, **kw)
    one = client.completions.create(temperature=0, **kw).choices[0].text
    assert [c.text for c in greedy.choices] == [one, one]


def test_a_decode_worker_killed_mid_stream_loses_and_repeats_no_token_of_any_choice(client, stack):
    kw = {"model": MODEL, "prompt": "Count slowly from one to fifty:", "max_tokens": 40, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    reference = client.completions.create(**kw).choices[0].text
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    victim = None
    chunks = 0
    for ch in client.completions.create(n=3, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
            chunks += 1
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if chunks >= 9 and victim is None:  # a few tokens of every choice streamed: kill their decode worker
            loads = {n: asyncio.run(worker_load(n, stack.procs[n].address)).num_running for n in DECODES}
            victim = max(loads, key=loads.get)
            assert loads[victim] == 3  # the three choices run together, on one worker
            stack.procs[victim].signal(signal.SIGKILL)
    assert victim is not None
    assert texts == {0: reference, 1: reference, 2: reference}  # resumed elsewhere: no gap, no repeat
    assert finishes == {0: "length", 1: "length", 2: "length"}
