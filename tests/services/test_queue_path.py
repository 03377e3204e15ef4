"""The durable path: admission queue -> router -> workers -> result stream, as real processes.

The gateway's side (enqueue, read results, cancel) is played by the test with
the same library calls the gateway makes.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from services.queue import AdmissionQueue, QueuedRequest, ResultReader
from services.queue.cancel import request_cancel
from services.queue.dead_letters import DeadLetters
from tests.services.stack import Proc, Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url):
    # one router running at most 2 requests at once, so the queue fills and priorities matter
    with Stack(redis_url, prefill=1, decode=1,
               router_args=("--max-inflight", "2", "--claim-idle-ms", "1500")) as s:
        yield s


def request(rid: str, prompt: list[int], tier: str = "standard", max_tokens: int = 8, **sampling) -> QueuedRequest:
    return QueuedRequest(rid, "tests", tier, "SmolLM2-135M-Instruct", prompt,
                         {"max_tokens": max_tokens, "temperature": 0, **sampling})


async def collect(r, rid: str, timeout_s: float = 120) -> tuple[list[int], str, dict]:
    tokens, text = [], ""
    async for _, kind, data in ResultReader(r).read(rid, timeout_s=timeout_s):
        if kind == "chunk":
            tokens += data["token_ids"]
            text += data["text"]
        else:
            return tokens, text, {"type": kind, **data}
    raise AssertionError("the result stream ended without a terminal event")


def test_queued_request_streams_the_single_engine_tokens(stack, reference_engine, reference, with_redis):
    prompt = reference_engine.tokenizer.encode("The capital of France is")

    async def go(r):
        await AdmissionQueue(r).enqueue(request("q-basic", prompt, max_tokens=10))
        return await collect(r, "q-basic")

    tokens, text, final = with_redis(go, flush=False, timeout_s=300)
    assert final["type"] == "final" and final["finish_reason"] in ("stop", "length")
    assert tokens == reference(prompt, 10)
    assert text == reference_engine.tokenizer.decode(tokens)
    assert final["usage"]["completion_tokens"] == len(tokens) and final["usage"]["prompt_tokens"] == len(prompt)
    assert final["timings"]["queue_ms"] >= 0 and final["timings"]["e2e_ms"] > 0


def test_interactive_overtakes_batch_and_batch_still_completes(stack, reference_engine, with_redis):
    prompt = reference_engine.tokenizer.encode("Tell me about the weather.")

    async def go(r):
        q = AdmissionQueue(r)
        for i in range(6):
            await q.enqueue(request(f"q-batch-{i}", prompt, "batch", max_tokens=12, ignore_eos=True))
        await asyncio.sleep(0.3)  # the router (2 in flight) is saturated with batch work
        for i in range(3):
            await q.enqueue(request(f"q-inter-{i}", prompt, "interactive", max_tokens=12, ignore_eos=True))
        order: list[str] = []

        async def wait(rid):
            await collect(r, rid)
            order.append(rid)

        await asyncio.gather(*(wait(f"q-batch-{i}") for i in range(6)), *(wait(f"q-inter-{i}") for i in range(3)))
        return order

    order = with_redis(go, flush=False, timeout_s=300)
    assert len(order) == 9  # every batch request completed too
    last_interactive = max(order.index(f"q-inter-{i}") for i in range(3))
    assert last_interactive < 6, f"interactive requests did not overtake the batch backlog: {order}"


def test_request_that_always_fails_is_dead_lettered_and_its_client_told(stack, reference_engine, with_redis):
    async def go(r):
        await AdmissionQueue(r).enqueue(request("q-bad", [10**7], max_tokens=4))  # outside the vocabulary
        _, _, final = await collect(r, "q-bad")
        # the client is told first, then the entry moves to the dead letters (one more round trip)
        for _ in range(100):
            dead = [d for d in await DeadLetters(r).list() if d.request_id == "q-bad"]
            if dead:
                break
            await asyncio.sleep(0.05)
        return final, dead

    final, dead = with_redis(go, flush=False, timeout_s=300)
    assert final["type"] == "error" and final["status"] == 400 and "vocabulary" in final["message"]
    assert len(dead) == 1 and "vocabulary" in dead[0].last_error


def test_cancel_reaches_the_workers_and_frees_blocks(stack, reference_engine, with_redis):
    prompt = reference_engine.tokenizer.encode("Count from one to a thousand:")

    async def go(r):
        await AdmissionQueue(r).enqueue(request("q-cancel", prompt, max_tokens=500, ignore_eos=True))
        reader = ResultReader(r).read("q-cancel", timeout_s=60)
        async for _, kind, _ in reader:
            if kind == "chunk":
                break
        await request_cancel(r, "q-cancel")
        events = [kind async for _, kind, _ in ResultReader(r).read("q-cancel", timeout_s=30)]
        return events

    events = with_redis(go, flush=False, timeout_s=300)
    assert events[-1] == "final"
    assert events.count("chunk") < 500
    assert stack.wait_idle(["prefill-0", "decode-0"]) == {"prefill-0": 0, "decode-0": 0}


def test_a_second_router_reclaims_what_a_dead_router_held(stack, reference_engine, reference, with_redis):
    """The stack's router is killed holding two requests; a new router resumes them without gaps."""
    prompt = reference_engine.tokenizer.encode("Write a long list of animals:")
    expected = reference(prompt, 40, ignore_eos=True)

    async def go(r):
        q = AdmissionQueue(r)
        for i in range(2):
            await q.enqueue(request(f"q-orphan-{i}", prompt, max_tokens=40, ignore_eos=True))
        async for _, kind, _ in ResultReader(r).read("q-orphan-0", timeout_s=60):
            if kind == "chunk":
                break
        stack.kill("router", signal.SIGKILL)
        second = Proc("router-2", [sys.executable, "-m", "services.cli", "router", "--redis-url", stack.redis_url,
                                   "--port", "0", "--claim-idle-ms", "1500"])
        stack.procs["router-2"] = second
        await asyncio.to_thread(second.wait_ready)
        return [await collect(r, f"q-orphan-{i}") for i in range(2)]

    for tokens, _, final in with_redis(go, flush=False, timeout_s=300):
        assert final["type"] == "final"
        assert tokens == expected  # resumed after the streamed tokens: no duplicate, no gap
    assert stack.wait_idle(["prefill-0", "decode-0"]) == {"prefill-0": 0, "decode-0": 0}
