"""The issue's reproduction, as a user runs it: ``pdserve up``'s defaults, a burst of concurrent chat requests
(half streaming, max_tokens 16) from the official ``openai`` client with its usual connection pooling.

Before the gateway read results over one connection, about half of 200 such requests failed (503
"Too many connections", 200-then-error streams, a traceback per request). Now every one is
served, the gateway holds at most 32 Redis connections whatever the burst, and logs nothing.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from services.bench.process_watch import ProcessWatch
from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BURST = 200


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    with LocalStack(StackSpec(prefill=1, decode=1, redis_url=redis_url)) as s:  # pdserve up's defaults
        yield s


async def _burst(base_url: str) -> list[tuple[str, str]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)

    async def one(i: int) -> tuple[str, str]:
        messages = [{"role": "user", "content": f"Give me word number {i} of a story."}]
        if i % 2:
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                                temperature=0, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    try:
        return await asyncio.gather(*(one(i) for i in range(BURST)))
    finally:
        await client.close()


def test_a_burst_from_the_openai_client_is_served_on_a_bounded_pool(stack):
    pids = {name: p.proc.pid for name, p in stack.procs.items()}
    with ProcessWatch(stack.redis_url, pids, interval_s=0.05) as watch:
        answers = asyncio.run(_burst(f"http://{stack.gateway_address}/v1"))  # raises on any failed request
    assert len(answers) == BURST
    assert all(text and finish in ("stop", "length") for text, finish in answers)
    assert 1 <= watch.peaks.processes["gateway"].redis_connections <= 32
    assert stack.procs["gateway"].trouble == []  # no warning, error or traceback in the gateway's log
