"""Two models behind one router and one gateway, as ``pdserve up --model A --model B`` starts them
(LocalStack), and ``model: "auto"``'s cascade over them, through the official openai client.

SmolLM2-135M is the small tier; ``dummy:smollm2-135m`` (the same shapes and vocabulary, random
weights, no tokenizer: it answers token ids without text) stands in for the large one. Each request
runs only on its model's workers (the worker that served it, read from the request's result stream,
announces that model in the registry); /v1/models and the router's ListModels list both; ``auto``
escalates or not as its threshold says, and the answer's ``model``, text and tokens show which tier
answered.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import redis

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.launcher import LocalStack, StackSpec
from services.queue.keys import result_stream
from services.registry import read_workers

pytestmark = pytest.mark.slow

SMALL = "SmolLM2-135M-Instruct"
LARGE = "dummy:smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 12


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=0, decode=1, more_models=[LARGE], dtype="fp32", threads=1, kv_cache_gb=0.25,
                     redis_url=redis_url)
    with LocalStack(spec) as s:
        s.redis_url = redis_url
        cascade = ["--cascade", f"{SMALL},{LARGE}", "--cascade-tokens", "4"]
        # the same stack behind two more gateways: one whose threshold every answer is under, one none is
        s.start_gateway("gw-always", [*cascade, "--cascade-threshold", "1"])
        s.start_gateway("gw-never", [*cascade, "--cascade-threshold=-inf"])
        yield s


def _client(stack, name: str = "gateway"):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{stack.procs[name].address}/v1", api_key="none", max_retries=0)


def _served_by(stack, request_id: str) -> str:
    """The model the decode worker that served ``request_id`` announces in the registry."""
    r = redis.Redis.from_url(stack.redis_url)
    final = next(json.loads(f[b"data"]) for _, f in r.xrange(result_stream(request_id)) if f[b"type"] == b"final")
    workers = {w.worker_id: w.model for w in asyncio.run(_workers(stack.redis_url))}
    return workers[final["decode_worker"]]


async def _workers(url: str):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        return await read_workers(client)
    finally:
        await client.aclose()


def _chat(client, model: str, stream: bool = False, **extra):
    return client.chat.completions.with_raw_response.create(
        model=model, messages=QUESTION, max_tokens=TOKENS, temperature=0, stream=stream,
        extra_body={"ignore_eos": True}, **extra)


def test_models_lists_every_served_model(stack):
    assert [m.id for m in _client(stack).models.list().data] == [SMALL, LARGE]
    assert [m.id for m in _client(stack, "gw-always").models.list().data] == [SMALL, LARGE, "auto"]


def test_each_request_runs_on_its_models_workers(stack):
    from concurrent.futures import ThreadPoolExecutor

    client = _client(stack)

    def ask(model, i):  # token ids: the dummy model has no tokenizer; each its own (twins would coalesce)
        raw = client.completions.with_raw_response.create(model=model, prompt=[1, 504, 3458, 282 + i],
                                                          max_tokens=TOKENS, temperature=0,
                                                          extra_body={"ignore_eos": True})
        return model, raw.parse(), _served_by(stack, raw.headers["x-request-id"])

    # one after another, each model twice in a row (a model-blind balancer alternates), then all at once
    answers = [ask(m, i) for i, m in enumerate((SMALL, SMALL, LARGE, LARGE))]
    with ThreadPoolExecutor(6) as pool:
        answers += list(pool.map(ask, (SMALL, LARGE) * 3, range(4, 10)))
    texts = {}
    for model, reply, served_by in answers:
        assert (reply.model, served_by) == (model, model)
        assert reply.usage.completion_tokens == TOKENS
        texts.setdefault(model, set()).add(reply.choices[0].text)
    assert texts[SMALL] != {""} and texts[LARGE] == {""}  # the dummy model answers ids without text


def test_router_grpc_routes_and_lists_by_model(stack):
    async def run():
        async with grpc.aio.insecure_channel(stack.router_address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            listed = await stub.ListModels(generate_pb2.ListModelsRequest())
            finish = None
            req = generate_pb2.GenerateRequest(model=LARGE, token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                                               sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0))
            async for msg in stub.Generate(req, timeout=120):
                if msg.HasField("finish"):
                    finish = msg.finish
            return listed, finish

    listed, finish = asyncio.run(run())
    assert {m.id for m in listed.models} == {SMALL, LARGE}
    workers = {w.worker_id: w.model for w in asyncio.run(_workers(stack.redis_url))}
    assert workers[finish.decode_worker] == LARGE


def test_unknown_model_is_a_404_and_auto_without_tiers_a_400(stack):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        _chat(_client(stack), "gpt-4o")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        _chat(_client(stack), "auto")
    assert "--cascade" in err.value.body["message"] and err.value.body["param"] == "model"


def test_auto_answers_from_the_small_tier_when_confident(stack):
    direct = _chat(_client(stack), SMALL).parse()
    raw = _chat(_client(stack, "gw-never"), "auto")
    reply = raw.parse()
    assert reply.model == SMALL
    assert reply.choices[0].message.content == direct.choices[0].message.content  # the small tier's own answer
    assert reply.usage.completion_tokens == TOKENS
    assert _served_by(stack, raw.headers["x-request-id"]) == SMALL


def test_auto_escalates_to_the_large_tier_and_streams_only_its_tokens(stack):
    client = _client(stack, "gw-always")
    raw = _chat(client, "auto")
    reply = raw.parse()
    assert reply.model == LARGE
    assert reply.choices[0].message.content == ""  # the large tier's answer: ids without text
    assert reply.usage.completion_tokens == TOKENS
    assert _served_by(stack, raw.headers["x-request-id"]) == LARGE

    stream = _chat(client, "auto", stream=True, stream_options={"include_usage": True}).parse()
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ""  # none of the small tier's held-back text reached the client
    assert {c.model for c in chunks if c.choices and c.choices[0].delta.content is None} >= {LARGE}
    assert chunks[-1].model == LARGE and chunks[-1].usage.completion_tokens == TOKENS

    never = _chat(_client(stack, "gw-never"), "auto", stream=True).parse()
    streamed = [c for c in never if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) != ""
    assert streamed[-1].model == SMALL


def _counter(stack, line_start: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://{stack.procs['router'].metrics}/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_escalations_and_answers_are_counted_by_tier(stack):
    escalated = f'pdserve_cascade_escalations_total{{from_model="{SMALL}",to_model="{LARGE}"}}'
    answered = {m: f'pdserve_cascade_answers_total{{model="{m}"}}' for m in (SMALL, LARGE)}
    before = [_counter(stack, escalated), *(_counter(stack, answered[m]) for m in (SMALL, LARGE))]
    _chat(_client(stack, "gw-always"), "auto")
    _chat(_client(stack, "gw-never"), "auto")
    after = [_counter(stack, escalated), *(_counter(stack, answered[m]) for m in (SMALL, LARGE))]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]
