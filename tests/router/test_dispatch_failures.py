"""Dispatch failures that are nobody's fault are handled, not passed on: found by `pdserve bench chaos`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.errors import NoWorkerError
from services.router.dispatch import DispatchConfig, Dispatcher


class _DecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self):
        self.aborted: list[str] = []

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse()


def test_abort_quietly_sends_the_abort_over_grpc():
    # prefill-kill: building this Abort raised TypeError (create_task on a grpc call), and the request whose
    # prefill worker died before Reserve returned reached its client as a 400 "bad sampling parameters"
    async def run():
        server = grpc.aio.server()
        worker = _DecodeWorker()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            dispatcher = Dispatcher(pool=None, index=None)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                dispatcher._abort_quietly(worker_pb2_grpc.DecodeWorkerStub(channel), "req-1.1", None)
                await asyncio.wait_for(asyncio.gather(*dispatcher._background), 10)
        finally:
            await server.stop(0)
        return worker.aborted

    assert asyncio.run(run()) == ["req-1.1"]


class _EmptyPool:
    """A worker pool that has no decode worker (every one restarting, or its heartbeats missed)."""

    def __init__(self):
        self.looked = 0

    def decode_workers(self, model: str = ""):
        self.looked += 1
        return []

    def models(self):
        return []


def test_no_decode_worker_for_a_moment_is_waited_out_not_failed_at_once():
    # transfer-fault: requests failed with "no decode worker is ready" the moment the
    # router's pool had none, while they came back a second later
    pool = _EmptyPool()
    dispatcher = Dispatcher(pool=pool, index=None, config=DispatchConfig(no_worker_wait_s=0.5))

    async def run():
        async for _ in dispatcher.generate("r", [1, 2, 3], None):
            pass

    with pytest.raises(NoWorkerError, match="no decode worker is ready"):
        asyncio.run(run())
    assert pool.looked > 3  # it kept looking for one while it waited
