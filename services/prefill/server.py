"""``pdserve prefill``: the PrefillWorker gRPC service around an engine.

Prefill(request, descriptor) runs the prompt prefill-only (prefix-cache hits
skip work) and writes its KV into the decode worker's reserved blocks as chunks
finish (services.engine.handoff.prefill_and_send), then answers the first token.
The request's blocks here are released when the call ends, on every path; a
cancelled call (router gone) aborts the request and the transfer.
"""

from __future__ import annotations

import time

import grpc

from kvtransfer import Sender, TransferDescriptor
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services import telemetry
from services.engine.handoff import prefill_and_send
from services.errors import InvalidRequestError
from services.grpc_codec import abort_with, check_deadline, sampling_from_proto
from services.worker import WorkerRuntime, add_worker_args, configs_from_args, run_worker


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.rt = runtime
        self.sender: Sender | None = None

    async def setup(self) -> None:
        engine = self.rt.engine
        self.sender = Sender(engine.kv_cache, engine.kv_spec, engine.namespace, self.rt.transfer)
        self.rt.aengine.on_step = lambda outputs: telemetry.BATCH_SIZE.labels(role="prefill").observe(len(outputs))

    async def teardown(self) -> None:
        if self.sender is not None:
            await self.sender.close()

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        req = request.request
        with telemetry.server_span("prefill", context, request_id=req.request_id, prompt_tokens=len(req.token_ids)):
            try:
                async with self.rt.admit():
                    check_deadline(req.deadline)
                    if not req.request_id:
                        raise InvalidRequestError("request_id is required", param="request_id")
                    params = sampling_from_proto(req.sampling)
                    try:
                        desc = TransferDescriptor.from_bytes(request.descriptor)
                    except Exception as exc:
                        raise InvalidRequestError(f"bad descriptor: {exc}", param="descriptor") from None
                    if desc.transfer_id != req.request_id:
                        raise InvalidRequestError(f"descriptor is for {desc.transfer_id!r}, not {req.request_id!r}",
                                                  param="descriptor")
                    started = time.perf_counter()
                    result = await prefill_and_send(self.rt.aengine, self.sender, desc, list(req.token_ids), params,
                                                    req.priority)
                    elapsed = time.perf_counter() - started
            except Exception as exc:
                await abort_with(context, exc)
            telemetry.TTFT_SECONDS.labels(role="prefill").observe(elapsed)
            return worker_pb2.PrefillResponse(first_token_id=result.first_token,
                                              cached_tokens=result.num_cached_tokens, prefill_ms=elapsed * 1e3)

    async def Abort(self, request: worker_pb2.AbortRequest, context):
        known = request.request_id in self.rt.engine.requests if self.rt.engine else False
        if known:
            self.rt.aengine.abort(request.request_id)
        return worker_pb2.AbortResponse(aborted=known)

    async def GetLoad(self, request, context):
        return load_message(self.rt)


def load_message(rt: WorkerRuntime) -> worker_pb2.WorkerLoad:
    s = rt.load()
    return worker_pb2.WorkerLoad(
        num_running=int(s.get("num_running", 0)), num_waiting=int(s.get("num_waiting", 0)),
        queued_prefill_tokens=int(s.get("queued_prefill_tokens", 0)),
        kv_blocks_total=int(s.get("kv_blocks_total", 0)), kv_blocks_used=int(s.get("kv_blocks_used", 0)),
        prefix_cache_queries=int(s.get("prefix_cache_queries", 0)),
        prefix_cache_hits=int(s.get("prefix_cache_hits", 0)),
        num_preemptions=int(s.get("num_preemptions", 0)), draining=bool(s.get("draining")))


def run(args) -> int:
    worker, engine, transfer = configs_from_args(args, "prefill")
    rt = WorkerRuntime(worker, engine, transfer)
    servicer = PrefillServicer(rt)

    def add(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        return ["pdserve.v1.PrefillWorker"]

    return run_worker(rt, add, servicer.setup, servicer.teardown)


def add_parser(sub) -> None:
    p = sub.add_parser("prefill", help="run one prefill worker (gRPC; registers in Redis)",
                       description="Run one prefill worker: computes prompts' KV and sends it to decode workers.")
    add_worker_args(p, "prefill")
    p.set_defaults(func=run)
