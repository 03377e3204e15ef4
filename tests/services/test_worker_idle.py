"""What an idle worker costs: its background loops (KV-event publishing, engine stats, LoRA sync) and its engine
thread do no work while nothing is served, and still do their job as soon as something is. The worker's real
loops over a dummy:tiny engine, a real Redis, and the router's real KV-event follower and index.

The old loops polled: the KV-event check every 20 ms, a stats read on the engine thread every 250 ms, a LoRA
sync on it every heartbeat, and the engine thread itself every 50 ms. The test shortens every interval (a few
ms) so that polling of any kind shows up as counted work within the idle window; it asserts counts, not times.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from kvtransfer import TransferConfig
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
ROLE = "idle-test"  # the engine loop's metric label, this test's alone


def _loop_passes() -> float:
    return REGISTRY.get_sample_value("pdserve_engine_loop_seconds_count", {"role": ROLE}) or 0.0


def test_an_idle_worker_does_no_work_and_a_busy_one_still_publishes(with_redis):
    engine = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=64 * TINY_BLOCK_BYTES))
    config = WorkerConfig(role="decode", kv_events_interval_s=0.002, stats_interval_s=0.005, heartbeat_s=0.01,
                          registry_ttl_s=1.0)
    runtime = WorkerRuntime(config, engine.config, TransferConfig(transport="loopback"))
    runtime.engine, runtime.aengine = engine, AsyncEngine(engine, role=ROLE)
    first, second = list(range(100, 140)), list(range(300, 340))  # 2 full blocks each
    params = SamplingParams(max_tokens=1, temperature=0)


    async def go(r):
        runtime.redis = r
        index = PrefixIndex()
        follower = KVEventFollower(r, index, block_ms=50, max_backoff_s=0.1)
        await follower.start()
        loops = [asyncio.create_task(runtime._publish_kv_events()), asyncio.create_task(runtime._poll_stats()),
                 asyncio.create_task(runtime._follow_loras())]
        worker = runtime.worker_id

        async def held(prompt) -> bool:
            return index.overlap(worker, hash_prompt_blocks(prompt, 16, engine.namespace)) == 2

        try:
            async for _ in runtime.aengine.generate(first, params):
                pass
            assert await until(lambda: held(first))
            await asyncio.sleep(0.2)  # every loop has caught up with that request (stats, LoRA sync)
            before = (runtime.aengine.activity, _loop_passes(), runtime.kv_event_wakeups, runtime.stats_reads)
            await asyncio.sleep(0.5)  # idle: at the intervals above, ~100 stats reads and ~250 checks if polling
            idle = (runtime.aengine.activity, _loop_passes(), runtime.kv_event_wakeups, runtime.stats_reads)

            async for _ in runtime.aengine.generate(second, params):
                pass
            published = await until(lambda: held(second))

            async def stats_caught_up():
                return runtime.stats_reads > idle[3] and runtime._stats.get("kv_blocks_used") == 0

            return before, idle, published, await until(stats_caught_up)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await follower.stop()

    try:
        before, idle, published, stats_fresh = with_redis(go)
    finally:
        runtime.aengine.shutdown()
    assert idle == before, ("an idle worker worked: engine commands, engine-loop passes, KV-event loop passes, stats "
                            f"reads went from {before} to {idle}")
    assert published, "the second request's blocks never reached the router's index"
    assert stats_fresh, "the stats were not read again after the engine worked"


def test_blocks_stored_before_the_publishing_loop_started_are_published(with_redis):
    """The loop sleeps until the engine thread says events wait, and the engine thread says so after a step. Blocks
    a step stored before the loop began watching (a request served while the loop was still starting) must not
    wait for the next request to be published."""
    engine = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=64 * TINY_BLOCK_BYTES))
    runtime = WorkerRuntime(WorkerConfig(role="decode", kv_events_interval_s=0.002), engine.config,
                            TransferConfig(transport="loopback"))
    runtime.engine, runtime.aengine = engine, AsyncEngine(engine)
    prompt = list(range(100, 140))  # 2 full blocks

    async def go(r):
        runtime.redis = r
        async for _ in runtime.aengine.generate(prompt, SamplingParams(max_tokens=1, temperature=0)):
            pass
        assert engine.has_kv_events()  # stored, and no one watching yet
        index = PrefixIndex()
        follower = KVEventFollower(r, index, block_ms=50, max_backoff_s=0.1)
        await follower.start()
        publishing = asyncio.create_task(runtime._publish_kv_events())
        try:
            async def held() -> bool:
                return index.overlap(runtime.worker_id, hash_prompt_blocks(prompt, 16, engine.namespace)) == 2

            return await until(held, timeout_s=5)
        finally:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)
            await follower.stop()

    try:
        assert with_redis(go), "blocks stored before the publishing loop started never reached the router's index"
    finally:
        runtime.aengine.shutdown()
