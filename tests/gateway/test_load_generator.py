"""The shared load generator (services/bench/load.py) against the real gateway: what it counts is what happened."""

from __future__ import annotations

import asyncio
import math

from services.bench.load import OpenAIClient, OpenAIRequest, closed_loop, open_loop, outcomes
from tests.gateway.fake_router import DEFAULT_PIECES, Plan
from tests.gateway.harness import wait_for


def client_for(h, **kw) -> OpenAIClient:
    return OpenAIClient("127.0.0.1", h.port, "SmolLM2-135M-Instruct", **kw)


def items(n: int, api: str = "chat") -> list[OpenAIRequest]:
    return [OpenAIRequest(api, f"Say {i}", 8, stream=i % 2 == 0, priority=("standard", "batch")[i % 2])
            for i in range(n)]


def test_a_burst_streaming_and_not_is_counted_completed_with_tokens_and_chunk_ids(gateway):
    h = gateway()
    h.router.plan = lambda req: Plan(delay_s=0.02)
    client = client_for(h, record_chunks=True)
    samples, wall = asyncio.run(open_loop(client.send, items(200), rate=math.inf))
    assert outcomes(samples) == {"completed": 200, "refused": 0, "other": 0}
    assert all(s.tokens == len(DEFAULT_PIECES) and s.request_id for s in samples)
    streamed = samples[0::2]
    assert all(len(s.gaps) == len(DEFAULT_PIECES) - 1 and 0 < s.ttft <= s.e2e for s in streamed)
    # each with its SSE id: the opening chunk, every piece, then the final event's two chunks (the finish
    # reason, then usage: the generator asks for include_usage)
    assert all(len(s.chunks) == len(DEFAULT_PIECES) + 3 for s in streamed)
    assert client.peak_open > 100 and client.open == 0  # they really were in flight together
    assert sorted(h.router.tiers_seen) == sorted(["standard", "batch"] * 100)


def test_refusals_with_retry_after_are_told_apart_from_failures(gateway):
    h = gateway(max_queued_requests=5)
    h.router.pause()
    client = client_for(h)

    async def run():
        burst = asyncio.ensure_future(open_loop(client.send, items(20, "completion"), rate=math.inf))
        await asyncio.to_thread(wait_for, lambda: client.open == 5)  # the refused ones are answered at once
        h.router.paused = False
        return await burst

    samples, _ = asyncio.run(run())
    assert outcomes(samples) == {"completed": 5, "refused": 15, "other": 0}
    assert {s.status for s in samples if s.outcome == "refused"} == {429}


def test_an_error_event_after_200_is_other_not_completed(gateway):
    h = gateway()
    h.router.plan = lambda req: Plan(error_after=2)
    stream = [OpenAIRequest("chat", "Hi", 8, stream=True)]
    [sample], _ = asyncio.run(open_loop(client_for(h).send, stream, rate=math.inf))
    assert sample.status == 200 and sample.outcome == "other" and "decode worker lost" in sample.error


def test_closed_loop_keeps_exactly_its_clients_busy(gateway):
    h = gateway()
    h.router.plan = lambda req: Plan(delay_s=0.02)
    client = client_for(h)
    samples, _ = asyncio.run(closed_loop(client.send, items(12), clients=3))
    assert outcomes(samples)["completed"] == 12
    assert client.peak_open == 3
