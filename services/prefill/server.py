"""``pdserve prefill``: the PrefillWorker gRPC service around an engine.

Prefill(request[, descriptor]) runs the prompt prefill-only (prefix-cache hits
skip work) and writes its KV into the decode worker's reserved blocks as chunks
finish (services.handoff.prefill_and_send), then answers the first token.
The call is a client stream: computing starts on its first message, and where
that carries no descriptor the second one does (the router reserves decode
blocks meanwhile); KV waits for it. The request's blocks here are released when
the call ends, on every path; a cancelled call (router gone, or no room on the
decode worker) aborts the request and the transfer.

Peer fetch (services/peer_fetch.py): a first message naming ``fetch`` has this worker pull the
prompt's leading blocks from that peer (its Fetch) before it prefills; a failed fetch is
computed instead. Fetch(request) is the holder's side: it sends a prefix it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from kvtransfer import Receiver, Sender, TransferDescriptor
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services import hops, telemetry
from services.grpc_channels import Channels
from services.handoff import EngineBlockOwner, parse_descriptor, prefill_and_send
from services.choice_requests import choice_params, choice_targets
from services.peer_fetch import fetch_prefix, serve_fetch
from services.errors import InvalidRequestError
from services.grpc_codec import abort_with, check_deadline, load_message, sampling_from_proto
from services.worker import WorkerRuntime, add_worker_parser, run_worker


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.rt = runtime
        self.sender: Sender | None = None
        self.owner: EngineBlockOwner | None = None
        self.receiver: Receiver | None = None  # peer fetches land here
        self.peers = Channels()

    async def setup(self) -> None:
        engine = self.rt.engine
        self.sender = Sender(engine.kv_cache, engine.namespace, self.rt.transfer)
        self.owner = EngineBlockOwner(self.rt.aengine)
        self.receiver = Receiver(engine.kv_cache, engine.namespace, self.owner, self.rt.transfer)
        await self.receiver.start()
        self.rt.aengine.on_step = lambda outputs: telemetry.BATCH_SIZE.labels(role="prefill").observe(len(outputs))

    async def teardown(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()  # fails open fetches, releasing their blocks
        if self.sender is not None:
            await self.sender.close()
        await self.peers.aclose()

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
                        target = parse_descriptor(request.descriptor, req.request_id)
                    else:  # it follows once the decode worker reserved blocks; compute meanwhile
                        target = asyncio.ensure_future(_next_descriptor(messages, req.request_id))
                    started = time.perf_counter()
                    if request.HasField("fetch") and request.fetch.num_blocks:
                        _check_fetch_source(request.fetch)
                        await self._fetch(req, request.fetch)
                    choices = []
                    if req.choices > 1:  # n choices: the prompt once, each choice's first token (decode/choices.py)
                        ids, _ = choice_targets(req)
                        choices = list(zip(ids[1:], choice_params(params, req.choices)[1:]))
                    result = await prefill_and_send(self.rt.aengine, self.sender, target, list(req.token_ids),
                                                    params, req.priority, request_id=req.request_id,
                                                    choices=choices)
                    elapsed = time.perf_counter() - started
                    hops.mark(hops.client_id(req.request_id), "prefill.done")
            except Exception as exc:
                await abort_with(context, exc)
            finally:
                if isinstance(target, asyncio.Future):
                    target.cancel()  # a no-op once done; its outcome is read either way, never left unretrieved
                    with contextlib.suppress(BaseException):
                        await target
            telemetry.TTFT_SECONDS.labels(role="prefill").observe(elapsed)
            telemetry.PROMPT_TOKENS.labels("prefill", self.rt.worker_id).inc(
                max(0, len(req.token_ids) - result.num_cached_tokens))
            return worker_pb2.PrefillResponse(first_token_id=result.first_token,
                                              cached_tokens=result.num_cached_tokens, prefill_ms=elapsed * 1e3)

    async def _fetch(self, req, source) -> None:
        """Pull the prompt's leading blocks from the peer the router named; a failure is computed."""
        stub = worker_pb2_grpc.PrefillWorkerStub(self.peers.get(source.address))
        outcome = await fetch_prefix(self.rt.aengine, self.owner, self.receiver, stub, f"{req.request_id}/fetch",
                                     list(req.token_ids), source.num_blocks, self.rt.config.transfer_timeout_s,
                                     self.rt.worker_id)
        hops.mark(hops.client_id(req.request_id), "prefill.fetched", blocks=outcome.blocks)
        if outcome.blocks and outcome.seconds > 0:  # the router prices the next fetch to this worker by it
            rate, old = outcome.nbytes / outcome.seconds, self.rt.fetch_bytes_per_s
            self.rt.fetch_bytes_per_s = rate if not old else 0.7 * old + 0.3 * rate

    async def Fetch(self, request: worker_pb2.FetchRequest, context: grpc.aio.ServicerContext):
        with telemetry.server_span("fetch", context, request_id=request.fetch_id, prompt_tokens=len(request.token_ids)):
            try:
                async with self.rt.admit():
                    if not request.fetch_id:
                        raise InvalidRequestError("fetch_id is required", param="fetch_id")
                    result = await serve_fetch(self.rt.aengine, self.sender, request.descriptor, request.fetch_id,
                                               list(request.token_ids), self.rt.worker_id)
            except Exception as exc:
                await abort_with(context, exc)
            return worker_pb2.FetchResponse(num_blocks=len(request.token_ids) // self.rt.engine.config.block_size,
                                            cached_tokens=result.num_cached_tokens)

    async def Abort(self, request: worker_pb2.AbortRequest, context):
        known = request.request_id in self.rt.engine.requests if self.rt.engine else False
        if known:
            self.rt.aengine.abort(request.request_id)
        return worker_pb2.AbortResponse(aborted=known)

    async def GetLoad(self, request, context):
        return load_message(self.rt.load())


def _check_fetch_source(source) -> None:
    """A fetch source names a gRPC host:port (the router takes it from the registry)."""
    host, _, port = source.address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise InvalidRequestError(f"fetch.address must be host:port, got {source.address[:100]!r}",
                                  param="fetch.address")


async def _next_descriptor(messages, request_id: str) -> TransferDescriptor:
    """The descriptor from the call's second message."""
    message = await anext(aiter(messages), None)
    if message is None or not message.descriptor:
        raise InvalidRequestError("the Prefill call ended without a descriptor (send it in the first or "
                                  "second message)", param="descriptor")
    return parse_descriptor(message.descriptor, request_id)


def run(args) -> int:
    return run_worker(args, "prefill", PrefillServicer, worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
                      "pdserve.v1.PrefillWorker")


def add_parser(sub) -> None:
    add_worker_parser(sub, "prefill", "run one prefill worker (gRPC; registers in Redis)",
                      "Run one prefill worker: computes prompts' KV and sends it to decode workers.", run)
