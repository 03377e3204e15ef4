"""``pdserve decode``: the DecodeWorker gRPC service around an engine.

Ownership of a reservation (see services.handoff)::

    Reserve  -> blocks held by this engine, transfer open in the Receiver
    Decode   -> claims it: waits for the KV, then joins the continuous batch
    no Decode within transfer_timeout + claim grace -> freed (router died)
    transfer fails / times out / is cancelled -> the Receiver releases the blocks
    Decode cancelled (router gone) -> transfer cancelled, or request aborted

Decode with ``local_prefill`` runs the whole request here (conditional
disaggregation), with no reservation. A request of n choices runs as one forked
generation either way (services/decode/choices.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import grpc

from kvtransfer import PendingTransfer, Receiver
from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import hops, phases, telemetry
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError, ReservationLostError
from services.grpc_codec import abort_with, check_deadline, chunk_from_output, load_message, sampling_from_proto
from services.choice_requests import choice_targets
from services.decode.choices import relay_choices
from services.decode.step_results import StepResultWriter
from services.handoff import EngineBlockOwner, decode_after_transfer, reserve_for_transfer
from services.registry import redis_client_options
from services.worker import WorkerRuntime, add_worker_parser, run_worker

_CLAIM_GRACE_S = 10.0
# A reservation holds KV blocks until its KV comes or this long: an hour bounds what one Reserve can hold
# (a fuzzed 1.6e16 s kept a block for good; the router's default asks for 60 s).
MAX_TRANSFER_TIMEOUT_S = 3600.0


@dataclass
class _Reservation:
    pending: PendingTransfer
    params: SamplingParams
    num_prompt_tokens: int
    results_to: str
    request: worker_pb2.WorkerRequest | None = None  # n choices (decode/choices.py): their ids and streams
    reserved_at: float = field(default_factory=time.perf_counter)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.rt = runtime
        self.owner: EngineBlockOwner | None = None
        self.receiver: Receiver | None = None
        self.reservations: dict[str, _Reservation] = {}
        self.results: StepResultWriter | None = None

    async def setup(self) -> None:
        import redis.asyncio as aioredis

        engine = self.rt.engine
        self.owner = EngineBlockOwner(self.rt.aengine)
        self.receiver = Receiver(engine.kv_cache, engine.namespace, self.owner, self.rt.transfer)
        await self.receiver.start()
        tok = engine.tokenizer
        results_redis = aioredis.Redis.from_url(self.rt.config.redis_url, **redis_client_options("pdserve-decode"))
        self.results = StepResultWriter(results_redis,
                                        (lambda t: tok.decode([t], skip_special_tokens=False)) if tok else None,
                                        worker_id=self.rt.worker_id, interval=self.rt.config.stream_interval,
                                        flush_ms=self.rt.config.stream_flush_ms)
        self.results.start()
        self.rt.aengine.on_step = self._on_step

    def _on_step(self, outputs) -> None:  # engine thread
        telemetry.BATCH_SIZE.labels(role="decode").observe(len(outputs))
        self.results.on_step(outputs, self.rt.aengine.steps)

    async def teardown(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()  # fails open transfers, releasing their blocks
        if self.results is not None:
            await self.results.stop()

    # ---- reservation ----------------------------------------------------
    async def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext):
        req = request.request
        hops.mark(hops.client_id(req.request_id), "decode.reserve")
        with telemetry.server_span("reserve", context, request_id=req.request_id):
            try:
                async with self.rt.admit():
                    check_deadline(req.deadline)
                    if not req.request_id:
                        raise InvalidRequestError("request_id is required", param="request_id")
                    if req.request_id in self.reservations:
                        raise InvalidRequestError(f"request {req.request_id!r} already has a reservation",
                                                  param="request_id")
                    params = sampling_from_proto(req.sampling)
                    if req.choices > 1:
                        choice_targets(req)  # a bad list is refused before anything is reserved
                    timeout = (request.transfer_timeout_s if request.HasField("transfer_timeout_s")
                               else self.rt.config.transfer_timeout_s)
                    if not 0 < timeout <= MAX_TRANSFER_TIMEOUT_S:  # NaN too
                        raise InvalidRequestError(f"transfer_timeout_s must be > 0 and at most "
                                                  f"{MAX_TRANSFER_TIMEOUT_S:g} s, got {timeout:g}",
                                                  param="transfer_timeout_s")
                    pending = await reserve_for_transfer(self.rt.aengine, self.owner, self.receiver, req.request_id,
                                                         list(req.token_ids), params, timeout, req.priority)
            except Exception as exc:
                await abort_with(context, exc)
            rid = req.request_id
            self.reservations[rid] = _Reservation(pending, params, len(req.token_ids), req.results_to,
                                                  req if req.choices > 1 else None)
            asyncio.get_running_loop().call_later(timeout + _CLAIM_GRACE_S, self._expire, rid, pending)
            return worker_pb2.ReserveResponse(descriptor=pending.descriptor.to_bytes(),
                                              num_blocks=pending.descriptor.num_blocks)

    def _expire(self, rid: str, pending: PendingTransfer) -> None:
        """Nobody claimed the reservation (the router died between Reserve and Decode): free it."""
        res = self.reservations.get(rid)
        if res is None or res.pending is not pending:
            return
        del self.reservations[rid]
        self._drop(rid, pending)

    def _drop(self, rid: str, pending: PendingTransfer) -> None:
        """Free an unclaimed reservation whatever its transfer's state."""
        if not pending.done():
            # open transfer: the receiver releases the blocks once no write can touch them
            self.receiver.cancel(rid, "reservation dropped")
        else:  # the KV arrived (a failed transfer was released by the receiver already)
            engine = self.rt.engine
            self.rt.aengine.submit(lambda: rid in engine.requests and engine.release(rid))

    # ---- decoding -------------------------------------------------------
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        req = request.request
        rid = req.request_id
        hops.mark(hops.client_id(rid), "decode.recv", step=self.rt.aengine.steps)
        with telemetry.server_span("decode", context, request_id=rid, local_prefill=request.local_prefill):
            started = time.perf_counter()
            try:
                if request.local_prefill:
                    async with self.rt.admit():
                        check_deadline(req.deadline)
                        if req.choices > 1:  # n choices, one forked generation
                            async for msg in relay_choices(self, req, started):
                                yield msg
                            return
                        params = sampling_from_proto(req.sampling)
                        outputs = self.rt.aengine.generate(list(req.token_ids), params, request_id=rid,
                                                           priority=req.priority)
                        async for msg in self._relay(rid, outputs, started, req.results_to):
                            yield msg
                else:
                    res = self.reservations.pop(rid, None)
                    if res is None:
                        # the router Decodes only what it reserved: the reservation was freed under it
                        # (expired, aborted). The server's fault, not the request's: not a 400 but
                        # ABORTED, which the router retries on another worker.
                        raise ReservationLostError(f"request {rid!r} has no reservation here (expired or "
                                                   "freed before its Decode came)")
                    async for msg in self._decode_reserved(rid, res, started):
                        yield msg
            except Exception as exc:
                await abort_with(context, exc)

    async def _decode_reserved(self, rid: str, res: _Reservation, started: float):
        completion = None
        claimed = False
        async with self.rt.track():  # admitted at Reserve; drain waits for it
            try:
                try:
                    with telemetry.tracer("pdserve.decode").start_as_current_span(
                            "kv_transfer", attributes={"request_id": rid}):
                        completion = await res.pending
                except asyncio.CancelledError:
                    self.receiver.cancel(rid, "the decode call was cancelled")
                    raise
                hops.mark(hops.client_id(rid), "decode.kv", step=self.rt.aengine.steps)
                telemetry.KV_TRANSFER_SECONDS.labels(role="decode").observe(completion.seconds)
                phases.observe("kv_transfer_wait", completion.seconds, role="decode")
                telemetry.KV_TRANSFER_BYTES.labels(role="decode").inc(completion.nbytes)
                claimed = True
                if res.request is not None:  # n choices, forked off the KV received once
                    async for msg in relay_choices(self, res.request, started, completion):
                        yield msg
                    return
                outputs = decode_after_transfer(self.rt.aengine, rid, completion)
                async for msg in self._relay(rid, outputs, started, res.results_to):
                    yield msg
            finally:
                if completion is not None and not claimed:
                    # the KV arrived just as we were cancelled: the reservation is still held
                    engine = self.rt.engine
                    self.rt.aengine.submit(lambda: rid in engine.requests and engine.release(rid))

    async def _relay(self, rid: str, outputs, started: float, results_to: str):
        """Outputs -> chunks on the stream, or (results mode) into Redis with only the Finish here: then the
        step hook writes every token (and counts it), and this stream gets only the last output."""
        tok = self.rt.engine.tokenizer
        token_text = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok else None
        first_at = last_at = None
        tokens = telemetry.GENERATION_TOKENS.labels("decode", self.rt.worker_id)
        itl = telemetry.INTER_TOKEN_LATENCY_SECONDS.labels(role="decode")
        if results_to:  # before the request's first step: see start_decode
            self.results.track(rid, results_to)
            self.rt.aengine.finals_only.add(rid)
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if out.error:
                        raise RuntimeError(out.error)
                    if not results_to and (out.new_token_ids or out.new_text):
                        tokens.inc(len(out.new_token_ids))
                        now = time.perf_counter()
                        if first_at is None:
                            first_at = now
                        elif out.new_token_ids:
                            itl.observe(now - last_at)
                        last_at = now
                        yield worker_pb2.TokenChunkOrFinish(chunk=chunk_from_output(out, token_text))
                    if out.finished:
                        if results_to:
                            await self.results.flushed(rid)
                            first_at = self.results.first_at.get(rid)
                        yield self._finish(out, started, first_at)
        finally:
            if results_to:
                self.rt.aengine.finals_only.discard(rid)
                self.results.untrack(rid)

    def _finish(self, out, started: float, first_at: float | None) -> worker_pb2.TokenChunkOrFinish:
        now = time.perf_counter()
        return worker_pb2.TokenChunkOrFinish(finish=common_pb2.Finish(
            finish_reason=out.finish_reason or "stop",
            usage=common_pb2.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                                   cached_prompt_tokens=out.num_cached_tokens),
            timings=common_pb2.Timings(ttft_ms=((first_at or now) - started) * 1e3, e2e_ms=(now - started) * 1e3),
            decode_worker=self.rt.worker_id))

    async def Abort(self, request: worker_pb2.AbortRequest, context):
        rid = request.request_id
        res = self.reservations.pop(rid, None)
        if res is not None:
            self._drop(rid, res.pending)
            return worker_pb2.AbortResponse(aborted=True)
        known = self.rt.engine is not None and rid in self.rt.engine.requests
        # A claimed reservation whose KV is still coming: the receiver frees the blocks once no chunk
        # can land in them (kvtransfer/ownership.py), and the Decode call ends with the transfer's error.
        # Aborting the request here too would free them under a chunk being written.
        if known and not self.receiver.cancel(rid, "aborted"):
            self.rt.aengine.abort(rid)
        return worker_pb2.AbortResponse(aborted=known)

    async def GetLoad(self, request, context):
        return load_message(self.rt.load())


def run(args) -> int:
    return run_worker(args, "decode", DecodeServicer, worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
                      "pdserve.v1.DecodeWorker")


def add_parser(sub) -> None:
    add_worker_parser(sub, "decode", "run one decode worker (gRPC; registers in Redis)",
                      "Run one decode worker: reserves KV blocks, receives prefilled KV, decodes.", run)
