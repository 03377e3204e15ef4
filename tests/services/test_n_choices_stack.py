"""``n`` > 1 and ``best_of`` over the real disaggregated stack with the openai client: the real model's
choices (greedy identical, seeded reproducible per choice), usage, streamed indexes, best_of's ranking."""

from __future__ import annotations

import json

import grpc
import pytest
import redis

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()  # test_children_share_the_full_prompt_blocks reads every result stream
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url,
                     gateway_grpc_port=0)
    with LocalStack(spec) as s:
        s.grpc_address = s.gateway_grpc_address
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)


def test_greedy_n3_gives_three_identical_choices_and_usage_counts_the_prompt_once(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, n=3, temperature=0, max_tokens=12)
    one = client.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {one.choices[0].message.content}
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_seeded_n3_is_reproducible_per_choice_and_choice_i_is_seed_plus_i(client):
    def texts(**kw):
        r = client.completions.create(model=MODEL, prompt="The sea is", temperature=1.0, max_tokens=12, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = texts(n=3, seed=11)
    assert texts(n=3, seed=11) == first
    assert len(set(first)) > 1  # three seeds, three samples
    assert [texts(seed=11 + i)[0] for i in range(3)] == first


def test_streamed_n2_chunks_carry_their_choice_index(client):
    chunks = list(client.completions.create(model=MODEL, prompt="The sea is", n=2, seed=3, temperature=1.0,
                                            max_tokens=8, stream=True, stream_options={"include_usage": True}))
    streamed = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.text
    whole = client.completions.create(model=MODEL, prompt="The sea is", n=2, seed=3, temperature=1.0, max_tokens=8)
    assert streamed == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(client):
    kw = {"model": MODEL, "prompt": "The sea is", "temperature": 1.0, "max_tokens": 8, "seed": 21}
    every = client.completions.create(n=3, logprobs=0, **kw)
    best = max(every.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    r = client.completions.create(best_of=3, **kw)
    assert len(r.choices) == 1 and r.choices[0].text == best.text and r.choices[0].logprobs is None


def test_choices_take_the_whole_prompt_from_the_first_partial_block_included(client, redis_url):
    """The first choice computes the prompt; the others fork it whole (the full blocks shared, the partial
    last block copied): each reports every prompt token as cached."""
    prompt = "The history of the sea and its sailors, told slowly. " * 30
    r = client.completions.create(model=MODEL, prompt=prompt, n=4, seed=1, temperature=1.0, max_tokens=4)
    store = redis.Redis.from_url(redis_url)
    cached = []
    for key in store.scan_iter("pd:res:*"):
        if key.endswith(b":inbox") or store.type(key) != b"stream":  # a gateway's delivery stream repeats the
            continue  # per-request streams' events; a fence is a string
        for _, fields in store.xrange(key):
            for value in fields.values():
                if b'"cached_prompt_tokens"' in value and b'"finish_reason"' in value:
                    usage = json.loads(value)["usage"]
                    if usage["prompt_tokens"] == r.usage.prompt_tokens:
                        cached.append(usage["cached_prompt_tokens"])
    assert sorted(cached) == [0] + [r.usage.prompt_tokens] * 3


def _grpc(address: str, **fields) -> list[generate_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        return list(generate_pb2_grpc.GenerationStub(channel).Generate(generate_pb2.GenerateRequest(**fields),
                                                                       timeout=120))


def test_grpc_n3_gives_the_same_choices_and_usage_as_http(stack, client):
    sampling = common_pb2.SamplingParams(seed=11, temperature=1.0, max_tokens=12)
    replies = _grpc(stack.grpc_address, text="The sea is", n=3, stream=False, sampling=sampling)
    http = client.completions.create(model=MODEL, prompt="The sea is", temperature=1.0, max_tokens=12, n=3, seed=11)
    texts = {r.index: r.chunk.text for r in replies if r.HasField("chunk")}
    assert texts == {c.index: c.text for c in http.choices}  # choice i: seed + i, on both APIs
    usage = replies[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (http.usage.prompt_tokens, http.usage.completion_tokens)
    streamed = _grpc(stack.grpc_address, text="The sea is", n=3, sampling=sampling)
    chunks: dict[int, str] = {}
    for r in streamed:
        if r.HasField("chunk"):
            chunks[r.index] = chunks.get(r.index, "") + r.chunk.text
    assert chunks == texts and streamed[-1].usage.completion_tokens == usage.completion_tokens


def test_grpc_best_of_returns_the_likeliest_candidate(stack):
    sampling = common_pb2.SamplingParams(seed=21, temperature=1.0, max_tokens=8, logprobs=0)
    every = _grpc(stack.grpc_address, text="The sea is", n=3, stream=False, sampling=sampling)
    chunks = [r.chunk for r in every if r.HasField("chunk")]
    likeliest = max(chunks, key=lambda c: sum(lp.logprob for lp in c.logprobs))
    best = _grpc(stack.grpc_address, text="The sea is", best_of=3, stream=False, sampling=common_pb2.SamplingParams(
        seed=21, temperature=1.0, max_tokens=8))
    [chunk] = [r.chunk for r in best if r.HasField("chunk")]
    assert chunk.text == likeliest.text and not chunk.logprobs


def test_the_routers_own_grpc_api_refuses_n_above_one(stack):
    with pytest.raises(grpc.RpcError) as info:
        _grpc(stack.router_address, text="The sea is", n=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gateway" in info.value.details()
