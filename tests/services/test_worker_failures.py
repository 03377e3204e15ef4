"""Workers dying or draining under load: retried elsewhere or a clear error; no hang, no leak.

The tests run in order on one stack (2 prefill, 2 decode workers) and each
takes a worker away: a prefill worker killed mid-request, a decode worker
killed mid-stream, then every prefill worker gone (the decode workers prefill
themselves), then a decode worker drained by SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from tests.services.stack import Stack

pytestmark = pytest.mark.slow

LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(50))


@pytest.fixture(scope="module")
def stack(redis_url):
    with Stack(redis_url, prefill=2, decode=2) as s:
        yield s


def _alive(stack: Stack, names: list[str]) -> list[str]:
    return [n for n in names if stack.procs[n].proc.poll() is None]


def _router_retries(stack: Stack) -> float:
    """``pdserve_retries_total{role="router"}`` from the router's /metrics (0 before the first retry)."""
    for line in stack.metrics("router").splitlines():
        if line.startswith('pdserve_retries_total{role="router"}'):
            return float(line.split()[-1])
    return 0.0


def test_prefill_worker_killed_mid_request_is_retried_elsewhere(stack, reference):
    prompts = [f"{LONG_PROMPT} Question {i}: which box is first?" for i in range(4)]
    retries_before = _router_retries(stack)

    async def run():
        tasks = [asyncio.create_task(stack.agenerate(stack.request(text=p, max_tokens=6))) for p in prompts]
        # the victim is a prefill worker computing some of them (the kv-aware router may send a shared
        # prefix's requests all to one worker: killing the idle one would test nothing)
        while True:
            loads = {n: await stack.aload(n) for n in ("prefill-0", "prefill-1")}
            busy = [n for n, load in loads.items() if load.num_running + load.num_waiting > 0]
            if busy:
                break
            await asyncio.sleep(0.05)
        stack.kill(busy[0])
        return busy[0], await asyncio.gather(*tasks)

    started = time.monotonic()
    victim, results = asyncio.run(run())
    assert time.monotonic() - started < 60
    for prompt, (ids, _, finish) in zip(prompts, results):
        assert ids == reference(prompt, 6)
        assert finish.prefill_worker != stack.procs[victim].worker_id
    assert _router_retries(stack) > retries_before, "no request was retried: the kill hit no prefill"
    survivor = "prefill-1" if victim == "prefill-0" else "prefill-0"
    assert stack.wait_idle([survivor, "decode-0", "decode-1"]) == {survivor: 0, "decode-0": 0, "decode-1": 0}
    stack.prefill_survivor = survivor


def test_decode_worker_killed_mid_stream_resumes_without_gaps(stack, reference):
    async def run():
        chunks: list[list[int]] = []
        victim = None
        async with grpc.aio.insecure_channel(stack.address) as ch:
            from proto.pdserve.v1 import generate_pb2_grpc

            req = stack.request(text="Count slowly from one to fifty:", max_tokens=40, ignore_eos=True)
            async for msg in generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120):
                if msg.HasField("chunk"):
                    chunks.append(list(msg.chunk.token_ids))
                    if len(chunks) == 5 and victim is None:
                        loads = {n: (await stack.aload(n)).num_running for n in ("decode-0", "decode-1")}
                        victim = max(loads, key=loads.get)
                        stack.kill(victim)
                else:
                    return chunks, msg.finish, victim
        raise AssertionError("no finish")

    chunks, finish, victim = asyncio.run(run())
    tokens = [t for c in chunks for t in c]
    assert tokens == reference("Count slowly from one to fifty:", 40, ignore_eos=True)
    assert finish.usage.completion_tokens == 40
    assert finish.decode_worker != stack.procs[victim].worker_id
    survivor = "decode-1" if victim == "decode-0" else "decode-0"
    prefill = stack.prefill_survivor
    assert stack.wait_idle(_alive(stack, [prefill, survivor])) == {prefill: 0, survivor: 0}
    stack.survivor = survivor


def test_with_no_prefill_worker_the_decode_worker_prefills(stack, reference):
    stack.kill(stack.prefill_survivor)
    ids, _, finish = stack.generate(stack.request(text="Name a fruit:", max_tokens=5))
    assert ids == reference("Name a fruit:", 5)
    assert finish.prefill_worker == ""  # prefilled locally
    assert stack.wait_idle([stack.survivor]) == {stack.survivor: 0}


def test_sigterm_drains_in_flight_work_then_deregisters(stack, reference):
    survivor = stack.survivor

    async def run():
        task = asyncio.create_task(stack.agenerate(stack.request(text="Tell me a story:", max_tokens=30,
                                                                 ignore_eos=True)))
        await asyncio.sleep(1.0)
        stack.kill(survivor, signal.SIGTERM)
        return await task

    ids, _, finish = asyncio.run(run())
    assert ids == reference("Tell me a story:", 30, ignore_eos=True)  # finished, not cut off
    assert stack.procs[survivor].proc.wait(30) == 0
    # no decode worker left: a clear error, not a hang
    with pytest.raises(grpc.aio.AioRpcError) as err:
        stack.generate(stack.request(text="hello", max_tokens=2), timeout_s=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker" in err.value.details()
