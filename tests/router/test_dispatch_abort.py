"""The router frees a reservation nobody will claim (the prefill failed before its descriptor was sent) with a
best-effort Abort over real gRPC; found by `pdserve bench chaos` (prefill-kill), where building that Abort raised
TypeError and the request reached its client as a 400 "bad sampling parameters"."""

from __future__ import annotations

import asyncio

import grpc

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.router.dispatch import Dispatcher


class _DecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self):
        self.aborted: list[str] = []

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse()


def test_abort_quietly_sends_the_abort_over_grpc():
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
