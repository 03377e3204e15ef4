"""Request coalescing through the real stack: gateway -> queue -> router -> prefill -> UCX -> decode.

"Computed once" is read where the work happens: the decode worker's
``pdserve_generation_tokens_total`` grows by one generation's tokens for eight
identical greedy requests. Each generation is long (``ignore_eos``, 48 tokens)
so that the twins, sent together, all arrive while the first one runs.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis

from services.gateway.coalesce_bench import metric_total
from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 48
BODY = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about the sea."}]}


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=1, decode=1, dtype="bf16", threads=1, kv_cache_gb=0.25, redis_url=redis_url,
                     gateway_args=["--disconnect-grace", "0.5"])
    with LocalStack(spec) as s:
        yield s


def generated(stack) -> float:
    return metric_total(stack.procs["decode-0"].metrics, "pdserve_generation_tokens_total")


def coalesced(stack) -> float:
    return metric_total(stack.gateway_address, "pdserve_gateway_coalesced_requests_total")


async def _one(http: httpx.AsyncClient, body: dict, stream: bool, cut_after: int | None = None) -> dict:
    """The text, response ids, usage and x-request-id a client sees (``cut_after``: leave after that many chunks)."""
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return {"rid": r.headers["x-request-id"], "text": data["choices"][0]["message"]["content"],
                "ids": {data["id"]}, "usage": data["usage"]}
    out = {"text": "", "ids": set(), "usage": None, "chunks": 0}
    async with http.stream("POST", "/v1/chat/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        out["rid"] = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = httpx.Response(200, content=line[6:]).json()
            assert "error" not in event, event
            out["ids"].add(event["id"])
            out["usage"] = event.get("usage") or out["usage"]
            if event["choices"]:
                out["text"] += event["choices"][0]["delta"].get("content") or ""
                out["chunks"] += 1
                if cut_after is not None and out["chunks"] >= cut_after:
                    return out
    return out


def _run(stack, *jobs):
    async def go():
        async with httpx.AsyncClient(base_url=f"http://{stack.gateway_address}", timeout=300) as http:
            return await asyncio.gather(*(_one(http, *job) for job in jobs))

    return asyncio.run(go())


def test_eight_identical_greedy_requests_are_one_generation(stack):
    before = generated(stack)
    alone, = _run(stack, (BODY, False))
    one_generation = generated(stack) - before
    assert alone["usage"]["completion_tokens"] == TOKENS and one_generation > 0

    before, joined = generated(stack), coalesced(stack)
    answers = _run(stack, *[(BODY, i % 2 == 0) for i in range(8)])  # streaming and not, mixed
    assert generated(stack) - before == one_generation  # one generation, not eight
    assert coalesced(stack) - joined == 7
    # one text for all eight (the request alone, run again, may differ: bf16 greedy parts at near-ties
    # between a cold prefill and one from the prefix cache)
    assert len({a["text"] for a in answers}) == 1 and answers[0]["text"]
    assert len({a["rid"] for a in answers}) == 8
    for a in answers:  # each answer is its own: its id, its usage
        assert a["ids"] == {f"chatcmpl-{a['rid']}"}
        assert a["usage"]["completion_tokens"] == TOKENS and a["usage"]["prompt_tokens"] > 0


def test_sampled_requests_without_a_seed_are_each_computed(stack):
    body = {**BODY, "temperature": 0.8, "messages": [{"role": "user", "content": "Name a colour."}]}
    before, joined = generated(stack), coalesced(stack)
    _run(stack, (body, False), (body, True))
    assert coalesced(stack) == joined
    seeded = {**body, "seed": 11}
    mid = generated(stack)
    assert mid - before > 1.5 * (TOKENS - 1)  # two generations
    first, second = _run(stack, (seeded, False), (seeded, True))
    assert first["text"] == second["text"] and coalesced(stack) - joined == 1
    assert generated(stack) - mid < 1.5 * TOKENS  # one


def test_one_twin_leaving_keeps_the_others_streaming(stack):
    body = {**BODY, "messages": [{"role": "user", "content": "Describe a forest."}]}
    cut, a, b = _run(stack, (body, True, 3), (body, True), (body, True))
    assert cut["chunks"] == 3
    assert a["text"] == b["text"] and a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == TOKENS
    assert b["text"].startswith(cut["text"])
