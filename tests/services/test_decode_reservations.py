"""The decode worker's reservations against its Abort, in one process: the real DecodeServicer on real gRPC,
KV chunks over the loopback transport held half-landed. Blocks go back only once no chunk can land in them
(kvtransfer/ownership.py), and every test ends with the engine's blocks all free."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from kvtransfer import Sender, TransferDescriptor
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.decode.server import DecodeServicer
from services.engine.kv_cache import allocate_kv_cache
from services.engine.sampling_params import SamplingParams
from services.grpc_codec import worker_request
from services.registry import WorkerInfo
from services.router.dispatch import DispatchConfig, Dispatcher
from services.router.prefix_index import PrefixIndex
from services.router.worker_pool import WorkerPool
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


class _ReplyHeldBack(DecodeServicer):
    """Reserves, then holds its reply back: the router's dispatch is cancelled after the worker reserved
    and before the router knew (the client left), so no Decode call will ever claim the reservation."""

    async def Reserve(self, request, context):
        reply = await super().Reserve(request, context)
        self.reserved.set()
        await asyncio.Event().wait()
        return reply


class _Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    """A prefill worker that takes the request and waits for the descriptor, which never comes."""

    async def Prefill(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        await asyncio.Event().wait()


def test_a_dispatch_cancelled_between_reserve_and_decode_frees_the_reservation_at_once():
    # issue 18: the unclaimed reservation stayed until the worker's expiry (transfer timeout + 10 s: 70 s
    # by default), holding blocks other requests waited for
    async def main():
        async with decode_worker(servicer_class=_ReplyHeldBack) as worker:
            worker.servicer.reserved = asyncio.Event()
            prefill = grpc.aio.server()
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Prefill(), prefill)
            prefill_address = f"127.0.0.1:{prefill.add_insecure_port('127.0.0.1:0')}"
            await prefill.start()
            engine = worker.engine
            pool = WorkerPool(redis=None)
            pool.update([WorkerInfo(worker_id=f"{role}-0", role=role, address=address, model=engine.model_name,
                                    namespace=engine.namespace, block_size=16, max_model_len=engine.max_model_len,
                                    ready=True, kv_blocks_total=engine.block_pool.num_usable)
                         for role, address in (("prefill", prefill_address), ("decode", worker.address))])
            # a reservation nobody claims would be held for 600 + 10 s
            dispatcher = Dispatcher(pool, PrefixIndex(), DispatchConfig(transfer_timeout_s=600))

            async def dispatch():
                async for _ in dispatcher.generate("q", PROMPT, SamplingParams(max_tokens=4, temperature=0)):
                    pass

            task = asyncio.create_task(dispatch())
            await worker.servicer.reserved.wait()
            held = await worker.used_blocks()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

            async def freed():
                while await worker.used_blocks():
                    await asyncio.sleep(0.05)

            try:
                await asyncio.wait_for(freed(), 20)
            except TimeoutError:
                pass
            left = await worker.used_blocks()
            await dispatcher.aclose()
            await prefill.stop(0)
            if left:  # what the worker's expiry would have done, 610 s later: the leak check stays clean
                worker.servicer._expire("q.1", worker.servicer.reservations["q.1"].pending)
            return held, left

    held, left = asyncio.run(main())
    assert held == 3
    assert left == 0, "the unclaimed reservation is still held"


def test_a_reserve_cancelled_while_the_engine_reserves_gives_the_blocks_back():
    # the Reserve call's handler is cancelled (the router gave up) while the engine thread reserves:
    # the reservation was made but nobody held it, and its blocks were never freed
    async def main():
        async with decode_worker() as worker:
            owner = worker.servicer.owner
            task = asyncio.create_task(owner.prepare("c", PROMPT, SamplingParams(max_tokens=4)))
            await asyncio.sleep(0)  # the engine thread has the reserve command
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await worker.servicer.rt.aengine.call(lambda: None)  # every command queued so far has run
            return await worker.used_blocks(), sorted(worker.engine.requests)

    assert asyncio.run(main()) == (0, [])


def test_a_decode_whose_reservation_is_gone_is_a_server_error_the_router_retries():
    # issue 18: a reservation freed under the router (expired, aborted) reached the client as a 400
    # dead letter (INVALID_ARGUMENT is never retried), although the request was fine
    async def main():
        async with decode_worker() as worker:
            call = worker.stub().Decode(worker_pb2.DecodeRequest(request=worker_pb2.WorkerRequest(request_id="g")))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc, Dispatcher(WorkerPool(redis=None), PrefixIndex())._failure(exc, None)

    error, failed = asyncio.run(main())
    assert error.code() == grpc.StatusCode.ABORTED and "no reservation here" in error.details()
    assert failed.retryable and failed.error.http_status == 500


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), 1.6e16])
def test_a_reserve_with_a_timeout_out_of_range_is_refused_and_holds_nothing(timeout_s):
    # the gRPC fuzz found a Reserve with transfer_timeout_s 1.6e16 s keeping a KV block for good
    async def main():
        async with decode_worker() as worker:
            request = worker_request("t", PROMPT, SamplingParams(max_tokens=4, temperature=0))
            try:
                await worker.stub().Reserve(worker_pb2.ReserveRequest(request=request, transfer_timeout_s=timeout_s))
            except grpc.aio.AioRpcError as exc:
                return exc, "t" in worker.servicer.reservations, await worker.used_blocks()
            return None, "t" in worker.servicer.reservations, await worker.used_blocks()

    error, reserved, used = asyncio.run(main())
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "transfer_timeout_s" in error.details()
    assert not reserved and used == 0
