"""The gateway over the real stack: openai client -> gateway -> queue -> router -> prefill -> UCX -> decode.

One stack (fp32, 1 prefill + 1 decode worker, router, gateway with a small queue bound);
the greedy reference is an in-process engine of the same model.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis

from services.launcher import LocalStack, StackSpec
from tests.gateway.sse_client import chat_text, events

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url,
                     gateway_args=["--max-queued-requests", "4", "--disconnect-grace", "5"])
    with LocalStack(spec) as s:
        yield s


@pytest.fixture(scope="module")
def reference_text(reference_engine):
    """The single engine's greedy text for a chat (its streamed deltas joined, as a client sees them)."""
    from services.engine.sampling_params import SamplingParams
    from tests.engine.checks import generate, text

    def run(messages: list[dict], max_tokens: int) -> str:
        prompt = reference_engine.tokenizer.apply_chat_template(messages)
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        return text(generate(reference_engine, {"reference": prompt}, params)["reference"])

    return run


def test_openai_client_streams_the_engines_greedy_text(stack, reference_text):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == reference_text(QUESTION, 16)
    assert "Paris" in text and usage.completion_tokens > 0
    # and without streaming
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == text


def test_resume_after_disconnect_equals_an_uninterrupted_run(stack, reference_text):
    messages = [{"role": "user", "content": "List the planets of the solar system."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}
    base = f"http://{stack.gateway_address}"
    with httpx.Client(base_url=base, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            first = events(r, limit=5)
        last_id = [e.id for e in first if e.id][-1]
        time.sleep(0.5)
        with http.stream("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": last_id}) as r:
            rest = events(r)
    assert rest[-1].done
    ids = [e.id for e in first + rest if e.id]
    assert len(ids) == len(set(ids))
    assert chat_text(first) + chat_text(rest) == reference_text(messages, 24)


def test_overload_gets_429_with_retry_after_and_loses_nothing(stack):
    base = f"http://{stack.gateway_address}"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(30)))

    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429}, codes
    rejected = [r for r in replies if r.status_code == 429]
    accepted = [r for r in replies if r.status_code == 200]
    assert rejected and accepted, codes
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "capacity_exceeded"
    for r in accepted:  # every admitted request completed with its tokens
        data = r.json()
        assert data["choices"][0]["text"] and data["usage"]["completion_tokens"] > 0
    # nothing is left queued or pending: no accepted request was lost on the way
    r = redis.Redis.from_url(stack.redis_url)
    assert sum(r.xlen(k) for k in r.scan_iter("pd:{q}:req:*")) == 0
    assert json.loads(httpx.get(f"{base}/health/ready").text)  # still serving
