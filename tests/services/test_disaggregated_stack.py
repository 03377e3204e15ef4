"""The disaggregated stack end to end: router -> prefill -> KV over UCX -> decode, as real processes.

One stack (2 prefill workers, 1 decode worker, kv-aware router, fp32) serves
every test in this module; each test ends with the leak check of
tests/services/conftest.py (no KV block in use on any worker once nothing runs).
"""

from __future__ import annotations

import asyncio
import random
import re

import grpc
import pytest

from tests.services.stack import Stack

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Paris is the capital of",
    "Explain gravity to a child in one sentence.",
    "1, 2, 3, 4,",
    "The best way to learn a language is",
]


@pytest.fixture(scope="module")
def stack(redis_url):
    with Stack(redis_url, prefill=2, decode=1) as s:
        yield s


def _counter(metrics: str, name: str, **labels) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_concurrent_greedy_output_equals_single_engine(stack, reference):
    async def run_all():
        return await asyncio.gather(*(stack.agenerate(stack.request(text=p, max_tokens=12)) for p in PROMPTS))

    results = asyncio.run(run_all())
    for prompt, (ids, text, finish) in zip(PROMPTS, results):
        expected = reference(reference.tokenizer.encode(prompt), 12)
        assert ids == expected, prompt
        assert text == reference.tokenizer.decode(expected)
        assert finish.usage.completion_tokens == len(ids)
        assert finish.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        assert finish.prefill_worker.startswith("prefill-") and finish.decode_worker.startswith("decode-")
        assert finish.finish_reason in ("stop", "length")


def test_chat_and_token_id_prompts(stack, reference):
    ids, text, finish = stack.generate(stack.request(chat="What is the capital of France?", max_tokens=10))
    assert "Paris" in text
    prompt = reference.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert finish.usage.prompt_tokens == len(prompt)
    ids2, _, _ = stack.generate(stack.request(token_ids=prompt, max_tokens=10))
    assert ids2 == ids == reference(prompt, 10)


def test_shared_prefix_goes_to_the_worker_that_cached_it(stack):
    prefix = " ".join(f"fact {i}: the sky was {['blue', 'grey', 'red'][i % 3]} on day {i}." for i in range(40))
    before = _counter(stack.metrics("router"), "pdserve_routing_decisions_total", reason="prefix_hit")
    _, _, first = stack.generate(stack.request(text=prefix + " Question one?", max_tokens=2))
    served_by = first.prefill_worker
    hits_before = _counter(stack.metrics(_name(stack, served_by)), "pdserve_prefix_cache_hits_total")
    # each question longer than a block: the decode worker, which holds the prefix too, would compute a
    # prompt whose blocks it all holds itself (test_first_token_path.py); these need a prefill worker
    for q in ("two", "three", "four"):
        question = f"Question {q}: " + " ".join(f"what happened on day {i} and why?" for i in range(4))
        _, _, finish = stack.generate(stack.request(text=f"{prefix} {question}", max_tokens=2))
        assert finish.prefill_worker == served_by
        assert finish.usage.cached_prompt_tokens >= finish.usage.prompt_tokens - 80  # all but the question
    after = _counter(stack.metrics("router"), "pdserve_routing_decisions_total", reason="prefix_hit")
    assert after - before >= 3
    # the worker's own prefix-cache hit counter grew (its stats reach /metrics every 0.25 s)
    _eventually(lambda: _counter(stack.metrics(_name(stack, served_by)), "pdserve_prefix_cache_hits_total")
                > hits_before)


def _burst(stack, texts: list[str]):
    async def run():
        return await asyncio.gather(*(stack.agenerate(stack.request(text=t, max_tokens=2)) for t in texts))

    return [finish for _, _, finish in asyncio.run(run())]


def test_burst_on_a_long_shared_prefix_computes_it_once(stack):
    # eight requests at once behind a ~650-token system prompt nobody has cached: its holder
    # computes it once (the others wait for its blocks and hit them), and computing it again on
    # the idle worker would cost more than that wait
    prefix = " ".join(f"rule {i}: always answer politely and precisely." for i in range(60))
    finishes = _burst(stack, [f"{prefix} Request {i}." for i in range(8)])

    assert len({f.prefill_worker for f in finishes}) == 1, [f.prefill_worker for f in finishes]
    cached = sorted(f.usage.cached_prompt_tokens for f in finishes)
    full_blocks = 16 * (min(f.usage.prompt_tokens for f in finishes) // 16)
    assert cached[0] < 16 * 8  # the first computed it (bar what earlier tests left cached)
    assert all(c >= full_blocks - 16 for c in cached[1:]), cached  # the rest hit all of it


def test_burst_on_a_short_shared_prefix_spreads_over_both_workers(stack):
    # the shared part saves a few tokens, each request's own ~100 tokens are the work: queueing
    # them all on one worker would cost more than the cache saves
    words = "apple river stone cloud market engine silver garden window thunder pencil harbor velvet".split()
    texts = []
    for i in range(8):
        rng = random.Random(i)
        texts.append("Be brief. " + " ".join(rng.choice(words) for _ in range(100)))
    served = [f.prefill_worker for f in _burst(stack, texts)]
    assert len(set(served)) == 2, f"every request went to one worker: {served}"


def test_bad_input_gets_invalid_argument(stack):
    cases = [
        (stack.request(text="", max_tokens=4), "text is empty"),
        (stack.request(token_ids=[10**7], max_tokens=4), "outside the vocabulary"),
        (stack.request(text="hi", max_tokens=4, temperature=-1.0), "temperature"),
        (stack.request(text="hi", max_tokens=4, top_p=0.0), "top_p"),
        (stack.request(token_ids=[1] * 10_000, max_tokens=4), "context"),
        (stack.request(max_tokens=4), "give a prompt"),
    ]
    for req, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            stack.generate(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        assert words in err.value.details(), err.value.details()
    req = stack.request(text="hi", max_tokens=4)
    req.model = "no-such-model"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        stack.generate(req)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.value.details()
    # the stack still serves
    _, text, _ = stack.generate(stack.request(text="Paris is the capital of", max_tokens=4))
    assert text


def test_prefill_call_needs_a_valid_descriptor(stack, reference):
    """The worker API: a Prefill stream whose descriptor never comes, or is garbage, is
    INVALID_ARGUMENT, and the prompt it started computing leaves no block behind."""
    from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    prompt = reference.tokenizer.encode("Explain gravity to a child in one sentence.")
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)

    async def call(*descriptors: bytes) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(stack.procs["prefill-0"].address) as ch:
            request = worker_pb2.WorkerRequest(request_id=f"direct-{len(descriptors)}", token_ids=prompt,
                                               sampling=sampling)
            messages = [worker_pb2.PrefillRequest(request=request)]
            messages += [worker_pb2.PrefillRequest(descriptor=d) for d in descriptors]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(iter(messages), timeout=60)
            return err.value

    never = asyncio.run(call())
    assert never.code() == grpc.StatusCode.INVALID_ARGUMENT and "without a descriptor" in never.details()
    garbage = asyncio.run(call(b"not a descriptor"))
    assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad descriptor" in garbage.details()


def test_client_going_away_frees_blocks(stack):
    async def abandon():
        task = asyncio.create_task(stack.agenerate(stack.request(text="Count to one hundred:", max_tokens=200,
                                                                 ignore_eos=True)))
        await asyncio.sleep(1.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(abandon())
    # the leak check (autouse fixture) asserts the decode worker freed the request's blocks


def test_tokenize_and_list_models(stack, reference):
    from proto.pdserve.v1 import generate_pb2, generate_pb2_grpc

    async def calls():
        async with grpc.aio.insecure_channel(stack.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            tok = await stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello world"))
            models = await stub.ListModels(generate_pb2.ListModelsRequest())
            return tok, models

    tok, models = asyncio.run(calls())
    assert list(tok.token_ids) == reference.tokenizer.encode("Hello world")
    assert models.models[0].id == "SmolLM2-135M-Instruct" and models.models[0].max_model_len > 1000
    assert tok.max_model_len == models.models[0].max_model_len


def _name(stack: Stack, worker_id: str) -> str:
    return next(n for n, p in stack.procs.items() if p.worker_id == worker_id)


def _eventually(check, timeout_s: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.1)


def test_worker_metrics_and_traces_are_exposed(stack):
    text = stack.metrics("decode-0")
    assert re.search(r'pdserve_kv_blocks_total\{role="decode",worker="decode-[^"]+"\} [1-9]', text)
    assert "pdserve_kv_transfer_seconds_bucket" in text
    assert "pdserve_ttft_seconds_count" in stack.metrics("router")
