"""Peer fetch lifecycle, in one process: two real PrefillServicers on real gRPC, KV over the loopback
transport. A prefill worker pulls a prefix another one holds (its pool or its spill tier) and then hits
it; a failed fetch (a corrupted chunk, a holder that stalls past the timeout, a holder that no longer
holds the prefix, a holder gone) computes the prefix instead, with the same answer. Every test ends with
every block in one place: both engines idle with all blocks free (tests/conftest.py's leak check), no
transfer open on the puller, no spill slot pinned on the holder."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvtransfer.faults import TransferFaults
from services import telemetry
from tests.engine.conftest import TINY_BLOCK_BYTES
from tests.services.prefill_inprocess import prefill_worker

pytestmark = pytest.mark.timeout(120)
BS = 16


def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _fetches(outcome: str) -> float:
    return sum(s.value for m in telemetry.KV_PEER_FETCHES.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("outcome") == outcome)


async def _idle(*workers) -> None:
    for w in workers:
        assert w.open_transfers() == 0
        assert await w.used_blocks() == 0


def test_a_fetched_prefix_is_hit_and_gives_the_holders_answer():
    prompt = _prompt(1)  # 100 tokens: 6 full blocks

    async def main():
        async with prefill_worker() as holder, prefill_worker() as puller:
            reference, _ = await holder.generate(prompt, "ref")
            ok_before = _fetches("ok")
            outcome = await puller.fetch_from(holder, "f1", prompt, 6)
            assert outcome.error == "" and outcome.blocks == 6
            assert outcome.nbytes == 6 * TINY_BLOCK_BYTES
            assert _fetches("ok") == ok_before + 1
            await _idle(holder, puller)  # the holder unpinned the blocks it sent, the puller's are cached
            tokens, cached = await puller.generate(prompt, "r1")
            assert cached == 6 * BS  # every full block fetched, none computed
            assert tokens == reference  # the received KV is the holder's, token for token
            again = await puller.fetch_from(holder, "f2", prompt, 6)
            assert again.blocks == 0 and again.error == ""  # held here now: nothing to fetch
            await _idle(holder, puller)

    asyncio.run(main())


def test_a_prefix_in_the_holders_spill_tier_is_restored_and_sent():
    prompts = [_prompt(10 + i, 150) for i in range(4)]  # 9 full blocks each through a 29-block pool

    async def main():
        spill = {"kv_spill_bytes": 64 * TINY_BLOCK_BYTES, "kv_spill_dtype": "auto"}
        async with prefill_worker(num_blocks=29, **spill) as holder, prefill_worker() as puller:
            first, _ = await holder.generate(prompts[0], "p0")
            for i, p in enumerate(prompts[1:], 1):
                await holder.generate(p, f"p{i}")
            assert await holder.aengine.call(lambda: len(holder.engine.block_pool.spill)) > 0
            outcome = await puller.fetch_from(holder, "f", prompts[0], 9)
            assert outcome.error == "" and outcome.blocks == 9
            tokens, cached = await puller.generate(prompts[0], "r")
            assert cached == 9 * BS and tokens == first
            await _idle(holder, puller)

    asyncio.run(main())


def test_a_corrupted_chunk_fails_the_fetch_and_the_prefix_is_computed():
    prompt = _prompt(2)

    async def main():
        async with prefill_worker() as holder, prefill_worker() as puller:
            reference, _ = await holder.generate(prompt, "ref")
            puller.servicer.receiver.faults = TransferFaults(corrupts={1})  # the first chunk lands damaged
            failed_before = _fetches("failed")
            outcome = await puller.fetch_from(holder, "f", prompt, 6)
            assert outcome.blocks == 0 and "checksum" in outcome.error
            assert _fetches("failed") == failed_before + 1
            await _idle(holder, puller)
            tokens, cached = await puller.generate(prompt, "r")
            assert cached == 0 and tokens == reference  # nothing of the bad bytes was cached
            await _idle(holder, puller)

    asyncio.run(main())


def test_a_holder_stalling_mid_transfer_times_out_and_both_sides_let_go():
    prompt = _prompt(3)

    async def main():
        async with prefill_worker() as holder, prefill_worker() as puller:
            reference, _ = await holder.generate(prompt, "ref")
            # the holder sends every block, then holds its finish back past the puller's timeout
            holder.servicer.sender.faults = TransferFaults(timeouts={1}, stall_s=3.0)
            outcome = await puller.fetch_from(holder, "f", prompt, 6, timeout_s=1.0)
            assert outcome.blocks == 0 and outcome.error
            await _idle(puller)
            tokens, cached = await puller.generate(prompt, "r")
            assert cached == 0 and tokens == reference
            for _ in range(100):  # the holder's stalled finish fails when it wakes, and it unpins its blocks
                if await holder.used_blocks() == 0 and not holder.engine.requests:
                    break
                await asyncio.sleep(0.1)
            await _idle(holder, puller)

    asyncio.run(main())


def test_a_holder_without_the_prefix_refuses_and_nothing_is_held():
    prompt = _prompt(4)

    async def main():
        async with prefill_worker() as holder, prefill_worker() as puller:
            await holder.generate(prompt[:40], "part")  # 2 full blocks of the 6 asked for
            outcome = await puller.fetch_from(holder, "f", prompt, 6)
            assert outcome.blocks == 0 and outcome.error.startswith("NOT_FOUND")
            await _idle(holder, puller)

    asyncio.run(main())


def test_a_holder_gone_during_the_fetch_falls_back_to_computing():
    prompt = _prompt(5)

    async def main():
        async with prefill_worker() as puller:
            async with prefill_worker() as holder:
                reference, _ = await holder.generate(prompt, "ref")
                holder.servicer.sender.faults = TransferFaults(timeouts={1}, stall_s=30.0)
                fetching = asyncio.create_task(puller.fetch_from(holder, "f", prompt, 6))
                while holder.servicer.sender.faults.injected == 0:  # blocks sent, finish held back
                    await asyncio.sleep(0.01)
            # the holder's server, sender and engine are gone (its leak check runs at the end)
            outcome = await asyncio.wait_for(fetching, 15)
            assert outcome.blocks == 0 and outcome.error
            await _idle(puller)
            tokens, cached = await puller.generate(prompt, "r")
            assert cached == 0 and tokens == reference

    asyncio.run(main())


def test_a_prefill_naming_a_malformed_fetch_source_is_invalid_argument():
    from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
    from services.grpc_codec import worker_request
    from services.engine.sampling_params import SamplingParams

    async def main():
        async with prefill_worker() as worker:
            stub = worker_pb2_grpc.PrefillWorkerStub(worker.channel)
            request = worker_pb2.PrefillRequest(
                request=worker_request("r", _prompt(6), SamplingParams(max_tokens=2, temperature=0)),
                fetch=worker_pb2.FetchSource(address="no port here", num_blocks=3))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(iter([request]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fetch.address" in err.value.details()
            await _idle(worker)

    asyncio.run(main())
