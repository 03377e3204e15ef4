"""A decode worker inside the test process: the real ``DecodeServicer`` over a ``dummy:tiny`` engine on real
gRPC (loopback), its KV transfers over the in-process loopback transport, whose chunks a test can hold
half-landed (``HeldChunks``) to stand at the moment a transfer is still writing into reserved blocks.

    async with decode_worker(HeldChunks()) as worker:
        stub = worker.stub()            # DecodeWorker over gRPC
        await worker.used_blocks()      # read on the engine thread

The engine is leak-checked after the test like every engine the test process builds (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc
import torch

from kvtransfer import Receiver, TransferConfig
from kvtransfer.loopback import LoopbackTransport
from kvtransfer.transport import Connection
from proto.pdserve.v1 import worker_pb2_grpc
from services.config import EngineConfig
from services.decode.server import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.engine import Engine
from services.handoff import EngineBlockOwner
from services.worker import WorkerConfig, WorkerRuntime
from tests.engine.conftest import TINY_BLOCK_BYTES


class _HeldConnection(Connection):
    """The receiving end of a loopback connection whose payloads wait for ``HeldChunks.land``."""

    def __init__(self, inner: Connection, held: "HeldChunks"):
        self.inner, self.held, self.peer = inner, held, inner.peer

    async def send(self, header: dict, payload: Sequence[torch.Tensor] = ()) -> None:
        await self.inner.send(header, payload)

    async def recv(self) -> dict:
        return await self.inner.recv()

    async def recv_payload(self, header: dict, dests) -> None:
        self.held.landing.set()
        await self.held.land.wait()
        await self.inner.recv_payload(header, dests)

    def close(self) -> None:
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed


class HeldChunks(LoopbackTransport):
    """Loopback transport whose receiver starts writing each chunk (``landing`` is set) and finishes it
    only once ``land`` is set."""

    def __init__(self):
        self.landing = asyncio.Event()
        self.land = asyncio.Event()

    async def listen(self, host, port, on_connection):
        return await super().listen(host, port, lambda conn: on_connection(_HeldConnection(conn, self)))


class InProcessDecode:
    def __init__(self, servicer: DecodeServicer, address: str, channel: grpc.aio.Channel):
        self.servicer, self.address, self.channel = servicer, address, channel
        self.engine = servicer.rt.engine

    def stub(self) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel)

    async def used_blocks(self) -> int:
        return await self.servicer.rt.aengine.call(lambda: self.engine.block_pool.num_used)


@contextlib.asynccontextmanager
async def decode_worker(transport=None, servicer_class=DecodeServicer, num_blocks: int = 64):
    engine = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=num_blocks * TINY_BLOCK_BYTES))
    runtime = WorkerRuntime(WorkerConfig(role="decode"), engine.config, TransferConfig(transport="loopback"))
    runtime.engine, runtime.aengine, runtime.ready = engine, AsyncEngine(engine), True
    servicer = servicer_class(runtime)
    servicer.owner = EngineBlockOwner(runtime.aengine)
    servicer.receiver = Receiver(engine.kv_cache, engine.namespace, servicer.owner, runtime.transfer,
                                 transport=transport)
    await servicer.receiver.start()
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield InProcessDecode(servicer, address, channel)
    finally:
        await server.stop(0)
        await servicer.receiver.close()
        runtime.aengine.shutdown()
