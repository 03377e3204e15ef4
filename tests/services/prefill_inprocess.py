"""Prefill workers inside the test process: the real ``PrefillServicer`` over a ``dummy:tiny`` engine on
real gRPC (loopback), KV over the in-process loopback transport (or the one a test passes), for the
peer-fetch lifecycle tests.

    async with prefill_worker() as holder, prefill_worker() as puller:
        await holder.generate(prompt)           # the holder caches the prompt
        outcome = await puller.fetch_from(holder, "f1", prompt, num_blocks)

Every engine is leak-checked after the test (tests/conftest.py); ``idle`` checks both transfer ends too.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from kvtransfer import TransferConfig
from proto.pdserve.v1 import worker_pb2_grpc
from services.config import EngineConfig
from services.engine.async_engine import AsyncEngine
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.peer_fetch import FetchOutcome, fetch_prefix
from services.prefill.server import PrefillServicer
from services.worker import WorkerConfig, WorkerRuntime
from tests.engine.conftest import TINY_BLOCK_BYTES

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


class InProcessPrefill:
    def __init__(self, servicer: PrefillServicer, address: str, channel: grpc.aio.Channel):
        self.servicer, self.address, self.channel = servicer, address, channel
        self.aengine = servicer.rt.aengine
        self.engine = servicer.rt.engine

    async def generate(self, prompt: list[int], rid: str, params: SamplingParams = GREEDY):
        """(tokens, prompt tokens served from the cache) of one request on this engine alone."""
        tokens, cached = [], 0
        async for out in self.aengine.generate(prompt, params, request_id=rid):
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
        return tokens, cached

    async def fetch_from(self, holder: "InProcessPrefill", fetch_id: str, prompt: list[int], num_blocks: int,
                         timeout_s: float = 10.0) -> FetchOutcome:
        stub = worker_pb2_grpc.PrefillWorkerStub(self.servicer.peers.get(holder.address))
        return await fetch_prefix(self.aengine, self.servicer.owner, self.servicer.receiver, stub, fetch_id, prompt,
                                  num_blocks, timeout_s)

    async def used_blocks(self) -> int:
        return await self.aengine.call(lambda: self.engine.block_pool.num_used)

    def open_transfers(self) -> int:
        return self.servicer.receiver.open_transfers


@contextlib.asynccontextmanager
async def prefill_worker(num_blocks: int = 64, transport: str = "loopback", **engine_config):
    engine = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=num_blocks * TINY_BLOCK_BYTES,
                                 **engine_config))
    runtime = WorkerRuntime(WorkerConfig(role="prefill"), engine.config, TransferConfig(transport=transport))
    runtime.engine, runtime.aengine, runtime.ready = engine, AsyncEngine(engine, role="prefill"), True
    servicer = PrefillServicer(runtime)
    await servicer.setup()
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield InProcessPrefill(servicer, address, channel)
    finally:
        await server.stop(0)  # cancels the calls in flight: their finally blocks queue their releases
        await servicer.teardown()
        for _ in range(50):  # a cancelled call's task may run its finally a moment after stop() returns
            if not await runtime.aengine.call(lambda: bool(engine.requests)):
                break
            await asyncio.sleep(0.1)
        runtime.aengine.shutdown()  # the leak check then finds what was never released
