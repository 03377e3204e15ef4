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
    ids = [e.id for e in first + rest if not e.done]  # [DONE] repeats the final event's id
    assert all(ids) and len(ids) == len(set(ids))
    assert chat_text(first) + chat_text(rest) == reference_text(messages, 24)


def test_overload_gets_429_with_retry_after_and_loses_nothing(stack):
    base = f"http://{stack.gateway_address}"
    # distinct prompts: identical greedy twins would be coalesced into one queued request
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={**body, "prompt": f"Once upon a time {i}"})
                                          for i in range(30)))

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
    # nothing is left queued or pending: no accepted request was lost on the way. The router writes a
    # request's final event before it acks (XDELs) the queue entry, so a client can read its reply a
    # moment before the entry goes: wait for that, not for ever (a lost entry stays)
    r = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + 10
    while (left := sum(r.xlen(k) for k in r.scan_iter("pd:{q}:req:*"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == 0
    assert json.loads(httpx.get(f"{base}/health/ready").text)  # still serving


def test_logprobs_cover_every_generated_token_the_first_included(stack):
    """The first token is sampled on the prefill worker; its logprobs travel with it to the decode worker
    (they were missing: chat had 5 entries for 6 tokens, completions' text_offset was off by the first)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)  # greedy

    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                     logprobs=1)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == done.usage.completion_tokens
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]

    stream = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    with_text = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert with_text and with_text[0].choices[0].logprobs.content  # the first streamed token has them too
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(streamed) == stream[-1].usage.completion_tokens


def test_responses_api_through_the_stack_equals_chat(stack, reference_text):
    """responses.create and its stream, with the official client, give the chat path's greedy text; a
    follow-up with previous_response_id sees the first turn."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)
    first = client.responses.create(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=16, temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text == reference_text(QUESTION, 16)
    streamed = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == first.output_text
    assert streamed[-1].response.output_text == first.output_text
    follow = [{"role": "user", "content": "And of Italy?"}]
    second = client.responses.create(model=MODEL, input=follow, previous_response_id=first.id,
                                      max_output_tokens=12, temperature=0)
    conversation = QUESTION + [{"role": "assistant", "content": first.output_text}] + follow
    assert second.output_text == reference_text(conversation, 12)
    assert client.responses.retrieve(second.id).output_text == second.output_text
