"""Peer fetch on the real stack (2 prefill workers, 1 decode, router with ``--peer-fetch``, UCX): the
router sends a returning prompt to the prefill worker that does not hold it and names the one that
does; that worker pulls the prefix over kvtransfer and computes only the rest, with the same answer.
When the holder dies mid-fetch (SIGKILL while its finish is held back), the puller computes the
prefix instead: the request still gets the same answer, and no block stays in use."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.services.stack import Stack
from tests.services.test_spill_stack import _counter

pytestmark = pytest.mark.slow
# round-robin: consecutive requests alternate between the two prefill workers, so a returning prompt
# always lands on the worker that does not hold it (kv-aware would send it to the holder when idle)
ROUTER = ("--policy", "round-robin", "--peer-fetch", "--disaggregation", "always")
PREFILLS = ("prefill-0", "prefill-1")


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(150)]  # 9 full blocks and 6 tokens


def _holder(stack: Stack) -> tuple[str, str]:
    """(the prefill worker that served the first request, the other one)."""
    served = [n for n in PREFILLS if stack.load(n).prefix_cache_queries > 0]
    assert len(served) == 1, served
    return served[0], next(n for n in PREFILLS if n != served[0])


def _registered(stack: Stack, worker_id: str):
    import asyncio

    import redis.asyncio as aioredis

    from services.registry import read_workers

    async def read():
        r = aioredis.Redis.from_url(stack.redis_url)
        try:
            return next(w for w in await read_workers(r) if w.worker_id == worker_id)
        finally:
            await r.aclose()

    return asyncio.run(read())


def _wait_counter(stack: Stack, worker: str, name: str, want: float, **labels) -> None:
    deadline = time.monotonic() + 10  # the counters are on /metrics at once; a margin for a loaded machine
    while _counter(stack.metrics(worker), name, **labels) < want:
        assert time.monotonic() < deadline, f"{worker}: {name}{labels} stayed below {want}"
        time.sleep(0.2)


def test_a_returning_prompt_is_fetched_from_the_other_prefill_worker(redis_url):
    prompt = _prompt(0)
    with Stack(redis_url, prefill=2, decode=1, router_args=ROUTER) as stack:
        ids, _, first = stack.generate(stack.request(token_ids=prompt, max_tokens=6))
        assert first.usage.cached_prompt_tokens == 0
        holder, puller = _holder(stack)
        again, _, finish = stack.generate(stack.request(token_ids=prompt, max_tokens=6))
        assert finish.usage.cached_prompt_tokens == 144  # 9 blocks fetched, the last (partial) one computed
        assert again == ids
        _wait_counter(stack, puller, "pdserve_kv_peer_fetches_total", 1, outcome="ok")
        _wait_counter(stack, holder, "pdserve_kv_peer_fetch_served_total", 1, outcome="ok")
        assert _counter(stack.metrics(puller), "pdserve_kv_peer_fetch_bytes_total") > 0
        # the puller heartbeats the rate it measured; the router prices its next fetches by it
        puller_id = stack.procs[puller].worker_id
        deadline = time.monotonic() + 10
        while _registered(stack, puller_id).kv_fetch_bytes_per_s <= 0:
            assert time.monotonic() < deadline, "the puller never reported its fetch rate"
            time.sleep(0.2)
        assert stack.wait_idle([*PREFILLS, "decode-0"]) == {holder: 0, puller: 0, "decode-0": 0}


def test_the_holder_dying_mid_fetch_leaves_the_puller_computing_the_prefix(redis_url, monkeypatch):
    prompt = _prompt(1)
    # every sender's 2nd transfer holds its finish back: the holder's is the fetch (its 1st was the first
    # request's hand-off to the decode worker); the puller's 2nd never happens
    monkeypatch.setenv("PDSERVE_KV_FAULTS", "timeout:2")
    monkeypatch.setenv("PDSERVE_KV_FAULT_STALL_S", "60")
    with Stack(redis_url, prefill=2, decode=1, router_args=ROUTER) as stack:
        ids, _, _ = stack.generate(stack.request(token_ids=prompt, max_tokens=6))
        holder, puller = _holder(stack)
        result = {}
        returning = threading.Thread(target=lambda: result.update(
            out=stack.generate(stack.request(token_ids=prompt, max_tokens=6))))
        returning.start()
        deadline = time.monotonic() + 60
        while "holding back the finish" not in stack.procs[holder].output():  # the blocks are on their way
            assert time.monotonic() < deadline, "the holder never started sending"
            time.sleep(0.05)
        stack.kill(holder)
        returning.join(90)
        again, _, finish = result["out"]
        assert again == ids and finish.usage.cached_prompt_tokens == 0  # computed on the puller
        _wait_counter(stack, puller, "pdserve_kv_peer_fetches_total", 1, outcome="failed")
        assert stack.wait_idle([puller, "decode-0"]) == {puller: 0, "decode-0": 0}
