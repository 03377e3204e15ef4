"""``n`` > 1 served as one forked generation, over the real stack with the real model and the openai client:
the prompt computed once for every choice and choices equal to separate requests, both where the decode
worker computes the prompt itself (a short prompt: the router's --local-prefill-max-tokens) and across the
hand-off (a long one: the prefill worker computes it and samples every choice's first token); a decode worker
killed mid-stream losing no token of any choice."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import grpc
import pytest

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.launcher import LocalStack, StackSpec
from tests.services.stack import worker_load

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
DECODES = ("decode-0", "decode-1")
LOCAL = 48  # prompts up to this many tokens are computed on the decode worker, longer ones handed off
SHORT = "The old lighthouse keeper said"
LONG = "A long account of the harbour, its boats and its storms, told slowly. " * 12


@pytest.fixture(scope="module")
def stack(redis_url):
    spec = StackSpec(prefill=1, decode=2, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url,
                     router_args=["--local-prefill-max-tokens", str(LOCAL), "--no-local-prefill-cached"],
                     gateway_args=["--disconnect-grace", "0.2", "--deadline-grace", "600"],
                     gateway_grpc_port=0)
    with LocalStack(spec) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)


def _prompt_tokens(stack) -> dict[str, float]:
    """``pdserve_prompt_tokens_total`` per role, of the workers still running: the prompt positions computed."""
    total = {"prefill": 0.0, "decode": 0.0}
    for name, p in stack.procs.items():
        if not name.startswith(tuple(total)) or not p.alive():
            continue
        text = urllib.request.urlopen(f"http://{p.metrics}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("pdserve_prompt_tokens_total{"):
                total[name.split("-")[0]] += float(line.split()[-1])
    return total


def _computed_since(stack, before: dict[str, float], expected: int) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while sum(_prompt_tokens(stack).values()) - sum(before.values()) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # a few more stats polls: anything computed twice would show by now
    return {role: n - before[role] for role, n in _prompt_tokens(stack).items()}


@pytest.mark.parametrize("where", ["local", "hand-off"])
def test_n4_computes_the_prompt_once(client, stack, where):
    prompt = f"{where}: " + (SHORT if where == "local" else LONG)
    before = _prompt_tokens(stack)
    r = client.completions.create(model=MODEL, prompt=prompt, n=4, seed=5, temperature=1.0, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 16
    computed = _computed_since(stack, before, r.usage.prompt_tokens)
    assert (r.usage.prompt_tokens <= LOCAL) == (where == "local")
    assert sorted(computed.values()) == [0, r.usage.prompt_tokens]  # once, by one worker
    # a long prompt is handed off, unless the prefill worker missed its heartbeat under load (then the decode
    # worker computes it: "no prefill worker ready"); a short one never leaves the decode worker
    assert computed["decode"] == r.usage.prompt_tokens or where == "hand-off"


@pytest.mark.parametrize("where", ["local", "hand-off"])
def test_each_choices_finish_names_the_workers_that_served_it(stack, where):
    """The gRPC API's per-choice Finish says who computed the prompt (and how long it took) as n = 1's does."""
    before = _prompt_tokens(stack)
    with grpc.insecure_channel(stack.gateway_grpc_address) as channel:
        replies = list(generate_pb2_grpc.GenerationStub(channel).Generate(generate_pb2.GenerateRequest(
            text=f"finish {where}: " + (SHORT if where == "local" else LONG), n=3, stream=False,
            sampling=common_pb2.SamplingParams(seed=7, temperature=1.0, max_tokens=3)), timeout=120))
    finishes = [r.finish for r in replies if r.HasField("finish")]
    decodes = {stack.procs[name].worker_id for name in DECODES}
    assert len(finishes) == 3 and all(f.decode_worker in decodes for f in finishes)
    computed = _computed_since(stack, before, finishes[0].usage.prompt_tokens)
    if computed["prefill"]:  # handed off (under load a long prompt may fall back to its decode worker)
        assert {f.prefill_worker for f in finishes} == {stack.procs["prefill-0"].worker_id}
        assert all(f.timings.prefill_ms > 0 for f in finishes)
    else:
        assert where == "local" or computed["decode"]
        assert {f.prefill_worker for f in finishes} == {""}
    assert where == "local" or computed["prefill"] or computed["decode"]


@pytest.mark.parametrize("where", ["local", "hand-off"])
def test_seeded_and_greedy_choices_equal_separate_requests(client, where):
    kw = {"model": MODEL, "prompt": SHORT if where == "local" else LONG, "max_tokens": 10}
    forked = client.completions.create(n=3, seed=40, temperature=1.0, logprobs=0, **kw)
    alone = [client.completions.create(seed=40 + i, temperature=1.0, logprobs=0, **kw).choices[0] for i in range(3)]
    assert [c.text for c in forked.choices] == [c.text for c in alone] and len({c.text for c in alone}) > 1
    for f, a in zip(forked.choices, alone):  # the first token (sampled on the prefill worker) carries its logprob
        assert f.logprobs.tokens == a.logprobs.tokens
        assert f.logprobs.token_logprobs == pytest.approx(a.logprobs.token_logprobs, abs=1e-3)
    greedy = client.completions.create(n=2, temperature=0, **kw)
    one = client.completions.create(temperature=0, **kw).choices[0].text
    assert [c.text for c in greedy.choices] == [one, one]


@pytest.mark.parametrize("where", ["local", "hand-off"])
def test_structured_choices_run_alone_and_each_validates(client, where):
    """Structured output does not fork (its grammar state is per choice): its choices run as requests of their
    own, on either path, each constrained."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SHORT if where == "local" else LONG}], n=2, seed=3,
        temperature=1.0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(json.loads(c.message.content)["answer"] in ("yes", "no") for c in r.choices)


@pytest.mark.parametrize("where", ["local", "hand-off"])
def test_a_client_leaving_mid_stream_cancels_every_choice_and_frees_their_blocks(client, stack, where):
    stream = client.completions.create(model=MODEL, prompt=SHORT if where == "local" else LONG, n=3, stream=True,
                                       max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    seen = set()
    for ch in stream:
        seen.update(c.index for c in ch.choices if c.text)
        if seen == {0, 1, 2}:
            break
    stream.close()
    _eventually_idle(stack)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_requests_past_their_deadline_end_with_a_deadline_error_at_once_and_free_their_blocks(stack, stream, n):
    """The router stops a generation at its deadline (n = 1 and n > 1, the stream's 200 sent or not): the
    client hears at once, not after the gateway's own grace (600 s here: the 60 s read timeout would fail the
    test), and the worker frees the slot."""
    import httpx

    body = {"model": MODEL, "prompt": LONG, "n": n, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(base_url=f"http://{stack.gateway_address}", timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body, headers={"x-pdserve-timeout": "1.5"}) as r:
            r.read()
    if stream:  # the 200 went out with the first chunks; the stream then ends with the error and [DONE]
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "deadline_exceeded"
    else:
        assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"
    _eventually_idle(stack)


def _eventually_idle(stack) -> None:
    """Every decode worker runs nothing and holds no KV block (within 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        loads = [asyncio.run(worker_load(n, stack.procs[n].address)) for n in DECODES]
        if not any(load.num_running or load.kv_blocks_used for load in loads):
            break
        time.sleep(0.2)
    assert [(load.num_running, load.kv_blocks_used) for load in loads] == [(0, 0), (0, 0)]


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
