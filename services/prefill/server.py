"""``pdserve prefill``: the PrefillWorker gRPC service around an engine.

Prefill(request[, descriptor]) runs the prompt prefill-only (prefix-cache hits
skip work) and writes its KV into the decode worker's reserved blocks as chunks
finish (services.handoff.prefill_and_send), then answers the first token.
The call is a client stream: computing starts on its first message, and where
that carries no descriptor the second one does (the router reserves decode
blocks meanwhile); KV waits for it. The request's blocks here are released when
the call ends, on every path; a cancelled call (router gone, or no room on the
decode worker) aborts the request and the transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from kvtransfer import Sender, TransferDescriptor
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services import hops, telemetry
from services.handoff import prefill_and_send
from services.errors import InvalidRequestError
from services.grpc_codec import abort_with, check_deadline, load_message, sampling_from_proto
from services.worker import WorkerRuntime, add_worker_parser, run_worker


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.rt = runtime
        self.sender: Sender | None = None

    async def setup(self) -> None:
        engine = self.rt.engine
        self.sender = Sender(engine.kv_cache, engine.namespace, self.rt.transfer)
        self.rt.aengine.on_step = lambda outputs: telemetry.BATCH_SIZE.labels(role="prefill").observe(len(outputs))

    async def teardown(self) -> None:
        if self.sender is not None:
            await self.sender.close()

    async def Prefill(self, messages, context: grpc.aio.ServicerContext):
        request = await anext(aiter(messages), None)
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Prefill needs a first message with the request")
        req = request.request
        target = None
        hops.mark(hops.client_id(req.request_id), "prefill.recv")
        with telemetry.server_span("prefill", context, request_id=req.request_id, prompt_tokens=len(req.token_ids)):
            try:
                async with self.rt.admit():
                    check_deadline(req.deadline)
                    if not req.request_id:
                        raise InvalidRequestError("request_id is required", param="request_id")
                    params = sampling_from_proto(req.sampling)
                    if request.descriptor:
                        target = _descriptor(request.descriptor, req.request_id)
                    else:  # it follows once the decode worker reserved blocks; compute meanwhile
                        target = asyncio.ensure_future(_next_descriptor(messages, req.request_id))
                    started = time.perf_counter()
                    result = await prefill_and_send(self.rt.aengine, self.sender, target, list(req.token_ids),
                                                    params, req.priority, request_id=req.request_id)
                    elapsed = time.perf_counter() - started
                    hops.mark(hops.client_id(req.request_id), "prefill.done")
            except Exception as exc:
                await abort_with(context, exc)
            finally:
                if isinstance(target, asyncio.Future) and not target.done():
                    target.cancel()
                    with contextlib.suppress(BaseException):
                        await target
            telemetry.TTFT_SECONDS.labels(role="prefill").observe(elapsed)
            telemetry.PROMPT_TOKENS.labels("prefill", self.rt.worker_id).inc(
                max(0, len(req.token_ids) - result.num_cached_tokens))
            return worker_pb2.PrefillResponse(first_token_id=result.first_token,
                                              cached_tokens=result.num_cached_tokens, prefill_ms=elapsed * 1e3)

    async def Abort(self, request: worker_pb2.AbortRequest, context):
        known = request.request_id in self.rt.engine.requests if self.rt.engine else False
        if known:
            self.rt.aengine.abort(request.request_id)
        return worker_pb2.AbortResponse(aborted=known)

    async def GetLoad(self, request, context):
        return load_message(self.rt.load())


def _descriptor(data: bytes, request_id: str) -> TransferDescriptor:
    try:
        desc = TransferDescriptor.from_bytes(data)
    except Exception as exc:
        raise InvalidRequestError(f"bad descriptor: {exc}", param="descriptor") from None
    if desc.transfer_id != request_id:
        raise InvalidRequestError(f"descriptor is for {desc.transfer_id!r}, not {request_id!r}", param="descriptor")
    return desc


async def _next_descriptor(messages, request_id: str) -> TransferDescriptor:
    """The descriptor from the call's second message."""
    message = await anext(aiter(messages), None)
    if message is None or not message.descriptor:
        raise InvalidRequestError("the Prefill call ended without a descriptor (send it in the first or "
                                  "second message)", param="descriptor")
    return _descriptor(message.descriptor, request_id)


def run(args) -> int:
    return run_worker(args, "prefill", PrefillServicer, worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
                      "pdserve.v1.PrefillWorker")


def add_parser(sub) -> None:
    add_worker_parser(sub, "prefill", "run one prefill worker (gRPC; registers in Redis)",
                      "Run one prefill worker: computes prompts' KV and sends it to decode workers.", run)
