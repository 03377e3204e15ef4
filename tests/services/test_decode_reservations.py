"""The decode worker's reservations against its Abort, in one process: the real DecodeServicer on real gRPC,
KV chunks over the loopback transport held half-landed. Blocks go back only once no chunk can land in them
(kvtransfer/ownership.py), and every test ends with the engine's blocks all free."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from kvtransfer import Sender, TransferDescriptor
from proto.pdserve.v1 import worker_pb2
from services.engine.kv_cache import allocate_kv_cache
from services.engine.sampling_params import SamplingParams
from services.grpc_codec import worker_request
from tests.services.decode_inprocess import HeldChunks, decode_worker

pytestmark = pytest.mark.timeout(60)
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16


async def _drain(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_abort_of_a_claimed_reservation_frees_its_blocks_only_once_no_chunk_can_land():
    # issue 18: Abort cancelled the receiver and then aborted the request at once, freeing blocks a chunk
    # was still being written into (the next request given them would have had its KV overwritten)
    async def main():
        held = HeldChunks()
        async with decode_worker(held) as worker:
            stub = worker.stub()
            params = SamplingParams(max_tokens=4, temperature=0)
            reserved = await stub.Reserve(worker_pb2.ReserveRequest(request=worker_request("r", PROMPT, params)))
            descriptor = TransferDescriptor.from_bytes(reserved.descriptor)
            decoding = asyncio.create_task(_drain(stub.Decode(worker_pb2.DecodeRequest(
                request=worker_pb2.WorkerRequest(request_id="r")))))
            while "r" in worker.servicer.reservations:  # until the Decode call has claimed it
                await asyncio.sleep(0.01)
            engine = worker.engine
            source = allocate_kv_cache(engine.kv_spec, 8)
            sender = Sender(source, engine.namespace, worker.servicer.rt.transfer, transport=held)
            sending = asyncio.create_task(sender.send_blocks(descriptor, [1, 2, 3]))
            await held.landing.wait()  # the chunk is being written into the reserved blocks
            aborted = await stub.Abort(worker_pb2.AbortRequest(request_id="r"))
            used_while_landing = await worker.used_blocks()
            held.land.set()
            code = await decoding
            with contextlib.suppress(Exception):
                await sending
            await sender.close()
            return aborted.aborted, used_while_landing, code

    aborted, used_while_landing, code = asyncio.run(main())
    assert aborted
    assert used_while_landing == 3  # still the transfer's while its chunk lands
    assert code == grpc.StatusCode.UNAVAILABLE  # the Decode call says its transfer was cancelled
