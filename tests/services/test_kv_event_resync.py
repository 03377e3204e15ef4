"""A worker's KV events that fail to publish: the router's prefix index converges again once Redis takes
writes, instead of missing those blocks until they are evicted. The worker's real publishing loop over a
dummy:tiny engine, a real Redis, and the router's real follower and index."""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import TransferConfig
from services import kv_events
from services.config import EngineConfig
from services.engine.async_engine import AsyncEngine
from services.engine.block_hash import hash_prompt_blocks
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.router.prefix_index import KVEventFollower, PrefixIndex
from services.worker import WorkerConfig, WorkerRuntime
from tests.engine.conftest import TINY_BLOCK_BYTES
from tests.services.stack import until

pytestmark = pytest.mark.timeout(60)


def test_events_lost_while_the_stream_refused_writes_are_resynced(with_redis):
    engine = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=64 * TINY_BLOCK_BYTES))
    runtime = WorkerRuntime(WorkerConfig(role="decode", kv_events_interval_s=0.01), engine.config,
                            TransferConfig(transport="loopback"))
    runtime.engine, runtime.aengine = engine, AsyncEngine(engine)
    before, during = list(range(100, 140)), list(range(300, 340))  # 2 full blocks each
    params = SamplingParams(max_tokens=1, temperature=0)

    async def held(index, worker, prompt) -> int:
        return index.overlap(worker, hash_prompt_blocks(prompt, 16, engine.namespace))


    async def go(r):
        runtime.redis = r
        index = PrefixIndex()
        follower = KVEventFollower(r, index, block_ms=50, max_backoff_s=0.1)
        await follower.start()
        publishing = asyncio.create_task(runtime._publish_kv_events())
        worker = runtime.worker_id
        try:
            async for _ in runtime.aengine.generate(before, params):
                pass
            assert await until(lambda: _eq(held(index, worker, before), 2))
            await r.set(kv_events.STREAM_KEY, "not a stream")  # every XADD fails (WRONGTYPE) from now
            async for _ in runtime.aengine.generate(during, params):
                pass
            async def failed():  # the blocks' events were taken, and their publish failed
                return runtime.kv_publisher.resync

            assert await until(failed)
            await r.delete(kv_events.STREAM_KEY)  # Redis takes writes again
            converged = await until(lambda: _eq(held(index, worker, during), 2))
            return converged, await held(index, worker, before)
        finally:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)
            await follower.stop()

    try:
        converged, still_before = with_redis(go)
    finally:
        runtime.aengine.shutdown()
    assert converged, "the blocks stored while publishing failed never reached the router's index"
    assert still_before == 2  # the resync kept what the index knew
    assert runtime.kv_publisher.resyncs == 1 and not runtime.kv_publisher.resync


async def _eq(value, expected) -> bool:
    return await value == expected
