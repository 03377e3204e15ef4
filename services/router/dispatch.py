"""Running one request through the workers: routing, the decode-first hand-off, retries.

One attempt::

    choose decode worker (free KV blocks, load)
    local prefill?  -> Decode(local_prefill)                     (conditional disaggregation)
    else            -> choose prefill worker (cached prefix vs load)
                       Prefill(request) opened: the prefill worker computes at once
                       Reserve on decode -> descriptor, the Prefill call's second message
                         (no room on the decode worker: the Prefill call is cancelled)
                       Decode(request_id) opened; the Decode stream yields once the KV has arrived

A failed attempt is retried on other workers, up to ``max_attempts``:

- before any token reached the caller: the same request again, avoiding the
  worker that failed (a prefill or transfer failure blames the prefill worker);
- after tokens were streamed (the decode worker died mid-stream): the prompt
  plus the tokens already streamed, with max_tokens reduced by as many, so the
  caller sees no duplicate or missing token (greedy output is unchanged;
  sampled output continues from a fresh random stream; a structured-output request's
  grammar replays the streamed tokens first).

An n > 1 request's one forked attempt (``generate_choices``, placed like any other with room for
its choices' copies of the partial last block) is not retried here: router/choices.py runs its
unfinished choices on alone.

Bad input (INVALID_ARGUMENT) is never retried. Each attempt has its own worker
request id (``<id>.<attempt>``, numbered on across redeliveries), so a failed attempt
still being torn down on a worker never collides with its retry, and the result
stream's fence (queue/results.py) drops any chunk it still had in flight. A caller that goes away cancels the
calls, which aborts the work and frees its blocks on both workers; an attempt that
ends without its Finish also Aborts its reservation, which no Decode call may claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import grpc

from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import hops, telemetry
from services.engine.block_hash import hash_prompt_blocks, request_namespace
from services.engine.sampling_params import SamplingParams
from services.errors import CapacityError, InvalidRequestError, NoWorkerError, PdserveError
from services.grpc_codec import check_deadline, error_from_rpc, worker_request
from services.registry import WorkerInfo
from services.grpc_channels import Channels
from services.router.placement import begin_decode, begin_prefill, place
from services.router.policy import RouterPolicyConfig, policy_from_config
from services.router.prefix_index import PrefixIndex
from services.router.worker_pool import WorkerPool

log = logging.getLogger(__name__)


@dataclass
class DispatchConfig:
    max_attempts: int = 3
    transfer_timeout_s: float = 60.0
    failed_worker_backoff_s: float = 5.0  # a worker whose RPC failed UNAVAILABLE is skipped this long
    # No decode worker has room for the prompt's KV right now: wait (backing off) this long for
    # running requests to finish before answering RESOURCE_EXHAUSTED. Waiting is not an attempt.
    capacity_wait_s: float = 30.0
    # No decode worker is ready (one restarting, heartbeats missed under load): wait this long for one
    # to come back before answering UNAVAILABLE (capped by capacity_wait_s).
    no_worker_wait_s: float = 10.0
    disaggregation: str = "auto"  # auto (conditional) | always | never

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 99:  # queue_worker numbers each delivery's attempts in a block of 100
            raise ValueError("max_attempts must be between 1 and 99")
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be > 0")
        if self.disaggregation not in ("auto", "always", "never"):
            raise ValueError(f"disaggregation must be auto, always or never; got {self.disaggregation!r}")


@dataclass
class _Served:
    """Reported by an attempt just before its Finish."""

    prefill_worker: str
    decode_worker: str
    cached_tokens: int
    prefill_ms: float


class _AttemptFailed(Exception):
    """``blame`` is the worker to avoid next time (None: nobody in particular)."""

    def __init__(self, error: PdserveError, blame: WorkerInfo | None, retryable: bool = True, wait: bool = False):
        super().__init__(error.message)
        self.error = error
        self.blame = blame
        self.retryable = retryable
        self.wait = wait  # a moment without decode workers (restarting, missed heartbeats): wait like no room

    @property
    def no_room(self) -> bool:
        """Every decode worker is full (or gone) for now: wait, it is nobody's fault."""
        return (self.wait or isinstance(self.error, CapacityError)) and self.retryable


class ChoicesFailed(Exception):
    """A forked attempt at n choices failed: ``retryable`` ones run again as one request per choice."""

    def __init__(self, error: PdserveError, retryable: bool):
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable


class _PrefillFailed(Exception):
    def __init__(self, rpc_error: grpc.aio.AioRpcError, worker: WorkerInfo):
        super().__init__(rpc_error.details())
        self.rpc_error = rpc_error
        self.worker = worker


def _prefill_failure(prefill_task: asyncio.Task | None) -> _PrefillFailed | None:
    if prefill_task is None or not prefill_task.done() or prefill_task.cancelled():
        return None
    exc = prefill_task.exception()
    return exc if isinstance(exc, _PrefillFailed) else None


class Dispatcher:
    def __init__(self, pool: WorkerPool, index: PrefixIndex, config: DispatchConfig | None = None,
                 policy_config: RouterPolicyConfig | None = None):
        self.pool = pool
        self.index = index
        self.config = config or DispatchConfig()
        self.policy_config = policy_config or RouterPolicyConfig()
        self.policy = policy_from_config(self.policy_config)
        self.channels = Channels()
        self._background: set[asyncio.Task] = set()

    async def generate(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0,
                       deadline: float = 0.0, results_to: str = "", emitted: list[int] | None = None,
                       read_emitted: Callable[[], Awaitable[list[int]]] | None = None, session_key: str = "",
                       fence: Callable[[str], Awaitable[None]] | None = None, attempt_base: int = 0,
                       model: str = "") -> AsyncIterator[common_pb2.TokenChunk | common_pb2.Finish]:
        """Stream the request's token chunks, then its Finish; raises a PdserveError on failure.

        ``results_to``: the decode workers write the chunks to that Redis result stream and
        only the Finish comes back here; ``read_emitted`` then tells, before a retry, which
        tokens the stream already holds (``emitted``: those it held before the first attempt,
        when a request is redelivered after a router died). ``session_key``: the client's
        affinity key ("" for none), a routing hint (policy.py). ``fence(wrid)``: called before
        ``read_emitted`` so that a failed attempt's chunk still on its way can no longer land
        after what was read (results.py). ``attempt_base``: added to the attempt numbers in worker
        request ids, so a redelivered request's attempts never reuse an earlier router's ids.
        ``model``: the base model whose workers (its pool) may serve it ("": any worker, one model
        served).
        """
        started = time.perf_counter()
        emitted = list(emitted or [])
        first_at = None
        served = _Served("", "", 0, 0.0)
        avoid_prefill: set[str] = set()
        avoid_decode: set[str] = set()
        outcome = "error"
        attempt = 0
        waited_until = time.monotonic() + self.config.capacity_wait_s
        no_worker_until = time.monotonic() + min(self.config.no_worker_wait_s, self.config.capacity_wait_s)
        backoff = 0.02
        try:
            while attempt < self.config.max_attempts:
                attempt += 1
                check_deadline(deadline)
                wrid = f"{request_id}.{attempt_base + attempt}"
                if read_emitted is not None and attempt > 1:
                    if fence is not None:
                        await fence(wrid)
                    emitted = await read_emitted()
                resumed_from = len(emitted)
                attempt_started = time.perf_counter()
                remaining = params
                if emitted and params.max_tokens is not None:
                    if params.max_tokens <= len(emitted):  # it had finished; only the final event was lost
                        yield common_pb2.Finish(finish_reason="length", usage=common_pb2.Usage(
                            prompt_tokens=len(token_ids), completion_tokens=len(emitted)))
                        outcome = "ok"
                        return
                    remaining = dataclasses.replace(params, max_tokens=params.max_tokens - len(emitted))
                if emitted and params.structured is not None:  # the grammar picks up where the stream is
                    remaining = dataclasses.replace(remaining, structured=dataclasses.replace(
                        params.structured, replay=params.structured.replay + tuple(emitted)))
                try:
                    async for item in self._attempt(wrid, token_ids + emitted, remaining,
                                                    priority, deadline, avoid_prefill, avoid_decode, results_to,
                                                    session_key, model):
                        if isinstance(item, _Served):
                            served = dataclasses.replace(item, cached_tokens=max(item.cached_tokens,
                                                                                  served.cached_tokens))
                        elif isinstance(item, common_pb2.TokenChunk):
                            if first_at is None and item.token_ids:
                                first_at = time.perf_counter()
                                telemetry.TTFT_SECONDS.labels(role="router").observe(first_at - started)
                            emitted.extend(item.token_ids)
                            yield item
                        else:
                            now = time.perf_counter()
                            if results_to:  # the chunks went to Redis; the decode worker counted them
                                item.usage.completion_tokens += resumed_from
                                if resumed_from == 0:
                                    item.timings.ttft_ms += (attempt_started - started) * 1e3
                            else:
                                item.usage.completion_tokens = len(emitted)
                                item.timings.ttft_ms = ((first_at or now) - started) * 1e3
                            item.usage.prompt_tokens = len(token_ids)
                            item.usage.cached_prompt_tokens = served.cached_tokens
                            item.timings.e2e_ms = (now - started) * 1e3
                            item.timings.prefill_ms = served.prefill_ms
                            item.prefill_worker = served.prefill_worker
                            item.decode_worker = served.decode_worker
                            telemetry.E2E_LATENCY_SECONDS.labels(role="router").observe(now - started)
                            outcome = "ok" if item.finish_reason != "abort" else "aborted"
                            yield item
                            return
                    raise _AttemptFailed(NoWorkerError("the decode worker ended its stream without a finish"),
                                         None)
                except _AttemptFailed as failed:
                    if failed.no_room and time.monotonic() + backoff < (no_worker_until if failed.wait
                                                                         else waited_until):
                        attempt -= 1  # same attempt number: its worker request id was never used
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 0.5)
                        continue
                    if not failed.retryable or attempt == self.config.max_attempts:
                        outcome = "invalid" if isinstance(failed.error, InvalidRequestError) else "error"
                        raise failed.error from None
                    if failed.blame is not None:
                        avoid = avoid_prefill if failed.blame.role == "prefill" else avoid_decode
                        avoid.add(failed.blame.worker_id)
                    telemetry.RETRIES.labels(role="router").inc()
                    log.warning("request %s: attempt %d failed (%s); retrying elsewhere", request_id, attempt,
                                failed.error.message)
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"
            raise
        finally:
            telemetry.REQUESTS.labels(role="router", outcome=outcome).inc()

    async def generate_choices(self, wrids: list[str], token_ids: list[int], params: SamplingParams, priority: int,
                               deadline: float, results_to: list[str], session_key: str = "", model: str = ""
                               ) -> AsyncIterator[tuple[int, common_pb2.Finish]]:
        """One attempt at an n-choice request as one forked generation (router/choices.py): the choices' worker
        request ids and result streams, choice 0's first; each choice's (index, Finish) as it ends. Raises
        ``ChoicesFailed`` (retryable or not) when the attempt fails."""
        check_deadline(deadline)
        started = time.perf_counter()
        served: _Served | None = None
        try:
            async for item in self._attempt(wrids[0], token_ids, params, priority, deadline, set(), set(),
                                            results_to[0], session_key, model, choices=(wrids[1:], results_to[1:])):
                if isinstance(item, _Served):  # reported once, before the first choice's Finish
                    served = item
                elif isinstance(item, tuple):
                    i, finish = item
                    finish.usage.prompt_tokens = len(token_ids)
                    if served is not None:  # which workers served the choices, as generate's Finish says
                        finish.usage.cached_prompt_tokens = max(finish.usage.cached_prompt_tokens,
                                                                served.cached_tokens)
                        finish.timings.prefill_ms = served.prefill_ms
                        finish.prefill_worker = served.prefill_worker
                        finish.decode_worker = finish.decode_worker or served.decode_worker
                    finish.timings.e2e_ms = (time.perf_counter() - started) * 1e3
                    yield i, finish
        except _AttemptFailed as failed:
            raise ChoicesFailed(failed.error, failed.retryable) from None

    async def _attempt(self, wrid: str, prompt: list[int], params: SamplingParams, priority: int, deadline: float,
                       avoid_prefill: set[str], avoid_decode: set[str], results_to: str = "", session_key: str = "",
                       model: str = "", choices: tuple[list[str], list[str]] | None = None):
        decode_workers = self.pool.decode_workers(model)
        if not decode_workers and model and len(self.pool.models()) <= 1 and model not in self.pool.models():
            # one model served under another name than the request's (a gateway given the model's path,
            # workers its file name): its workers are the only pool there is
            model = ""
            decode_workers = self.pool.decode_workers()
        if not decode_workers:
            of = f" of the model {model!r}" if model else ""
            raise _AttemptFailed(NoWorkerError(f"no decode worker{of} is ready"), None, wait=True)
        sample = decode_workers[0]
        block_size, namespace = sample.block_size, sample.namespace
        if len(prompt) >= sample.max_model_len:
            raise _AttemptFailed(InvalidRequestError(
                f"prompt has {len(prompt)} tokens, but the model's context is {sample.max_model_len} tokens "
                "(including at least one generated token); shorten the prompt", param="prompt"), None, False)
        prefill_workers = [w for w in self.pool.prefill_workers(model)
                           if w.namespace == namespace and w.worker_id not in avoid_prefill]
        if params.lora is not None:
            decode_workers = with_adapter(decode_workers, params.lora)
            if not decode_workers:  # an adapter just added: workers pick it up at their next heartbeat
                raise _AttemptFailed(NoWorkerError(f"no decode worker serves the LoRA adapter {params.lora!r} "
                                                   "yet"), None, wait=True)
            prefill_workers = with_adapter(prefill_workers, params.lora)
        # a LoRA request's blocks hash in its adapter's namespace, as the workers hash them
        hashes = hash_prompt_blocks(prompt, block_size, request_namespace(namespace, params.lora))
        try:
            placement = place(self.policy, self.policy_config, self.config.disaggregation, self.pool, self.index,
                              decode_workers, prefill_workers, hashes, len(prompt), block_size, avoid_decode,
                              session_key,
                              # n choices hold a copy of the prompt's partial last block each beside the shared ones
                              extra_blocks=0 if choices is None else len(choices[0]))
        except PdserveError as exc:
            blocks_needed = -(-len(prompt) // block_size)
            fits_somewhere = blocks_needed <= max(w.kv_blocks_total for w in decode_workers)
            raise _AttemptFailed(exc, None, retryable=isinstance(exc, CapacityError) and fits_somewhere) from None
        d = placement.decode
        decode = d.worker
        client_id = hops.client_id(wrid)
        hops.mark(client_id, "router.placed", local=placement.prefill is None)
        request = worker_request(wrid, prompt, params, priority, deadline, results_to)
        if choices is not None:
            request.choices = 1 + len(choices[0])
            request.choice_ids.extend(choices[0])
            request.choice_results_to.extend(choices[1] if results_to else ())
        decode_stub = worker_pb2_grpc.DecodeWorkerStub(self.channels.get(decode.address))
        metadata = telemetry.grpc_metadata()

        if placement.prefill is None:
            self._count(d.worker, "local_prefill")
            token = self.pool.begin(decode.worker_id, len(prompt))
            try:
                hops.mark(client_id, "router.sent")
                call = decode_stub.Decode(worker_pb2.DecodeRequest(request=request, local_prefill=True),
                                          metadata=metadata)
                served = False
                async for item in self._relay(call, decode, None, 1 if choices is None else request.choices):
                    if not served and isinstance(item, (common_pb2.Finish, tuple)):  # a choice's: (index, Finish)
                        served = True
                        finish = item if isinstance(item, common_pb2.Finish) else item[1]
                        yield _Served("", decode.worker_id, finish.usage.cached_prompt_tokens, 0.0)
                    yield item
            finally:
                self.pool.end(token)
            return

        choice = placement.prefill
        prefill = choice.worker
        self._count(prefill, "peer_fetch" if choice.fetch is not None else choice.reason)
        self._count(decode, d.reason)
        token = begin_prefill(self.pool, self.index, choice, hashes, len(prompt), block_size)
        decode_token = begin_decode(self.pool, d)
        prefill_task: asyncio.Task | None = None
        call = None
        # From the Reserve call on, the decode worker may hold blocks for this attempt. Unless the attempt
        # reaches its Finish, Abort them (idempotent there): a Decode call that never reached the worker
        # (cancelled between Reserve and Decode, or before Reserve answered) leaves nobody to claim them,
        # and the worker's own expiry comes only after the transfer timeout plus a grace.
        may_hold = finished = False
        try:
            # The prefill starts computing now; the descriptor follows once the decode worker
            # has reserved its blocks, so the Reserve round trip is not on the way to the first token.
            prefill_stub = worker_pb2_grpc.PrefillWorkerStub(self.channels.get(prefill.address))
            hops.mark(client_id, "router.sent")
            prefill_call = prefill_stub.Prefill(metadata=metadata)
            descriptor: asyncio.Future = asyncio.get_running_loop().create_future()
            # a peer fetch moves base-model blocks (services/peer_fetch.py): never one for an adapter's prompt
            fetch = None if choice.fetch is None or params.lora is not None else worker_pb2.FetchSource(
                address=choice.fetch.holder.address, num_blocks=choice.fetch.blocks)
            prefill_task = asyncio.create_task(self._prefill(prefill_call, request, descriptor, prefill, fetch))
            prefill_task.add_done_callback(lambda t: self.pool.end_prefill(token))
            may_hold = True
            try:
                reserved = await decode_stub.Reserve(worker_pb2.ReserveRequest(
                    request=request, transfer_timeout_s=self.config.transfer_timeout_s), metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                may_hold = False  # the worker answered: it reserved nothing
                raise self._failure(exc, decode) from None
            failed = _prefill_failure(prefill_task)
            if failed is not None:  # before it even needed the descriptor: nobody will claim the blocks
                raise self._failure(failed.rpc_error, failed.worker)
            descriptor.set_result(reserved.descriptor)
            call = decode_stub.Decode(worker_pb2.DecodeRequest(request=worker_pb2.WorkerRequest(request_id=wrid)),
                                      metadata=metadata)
            # A prefill that fails before the KV arrived must not leave the decode call waiting
            # out its transfer timeout: cancel the call, which frees the reservation.
            prefill_task.add_done_callback(
                lambda t: t.cancelled() or t.exception() is None or call.cancel())
            async for item in self._relay(call, decode, prefill_task, 1 if choices is None else request.choices):
                if not finished and isinstance(item, (common_pb2.Finish, tuple)):  # a choice's: (index, Finish)
                    finished = True
                    result = None
                    with contextlib.suppress(Exception):  # its reply trails the KV by a moment
                        result = await asyncio.wait_for(asyncio.shield(prefill_task), 5.0)
                    yield _Served(prefill.worker_id, decode.worker_id, result.cached_tokens if result else 0,
                                  result.prefill_ms if result else 0.0)
                yield item
        finally:
            self.pool.end(token)
            self.pool.end(decode_token)
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            if call is not None and not call.done():
                call.cancel()
            if may_hold and not finished:
                self._abort_quietly(decode_stub, wrid, metadata)

    def _count(self, worker: WorkerInfo, reason: str) -> None:
        telemetry.ROUTING_DECISIONS.labels(policy=self.policy_config.policy, role=worker.role,
                                           worker=worker.worker_id, reason=reason).inc()

    @staticmethod
    async def _prefill(call, request: worker_pb2.WorkerRequest, descriptor: asyncio.Future, worker: WorkerInfo,
                       fetch: worker_pb2.FetchSource | None = None):
        """The Prefill call: the request (and where to fetch its prefix from), then the descriptor
        once reserved; its response."""
        try:
            await call.write(worker_pb2.PrefillRequest(request=request, fetch=fetch))
            await call.write(worker_pb2.PrefillRequest(descriptor=await descriptor))
            await call.done_writing()
            return await call
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            raise _PrefillFailed(exc, worker) from None

    async def _relay(self, call, decode: WorkerInfo, prefill_task: asyncio.Task | None, finishes: int = 1):
        """The decode stream's chunks and finish; a failure becomes _AttemptFailed naming whom to blame.
        ``finishes`` > 1: a call of that many choices, each Finish yielded as (its choice's index, Finish)."""

        tagged = finishes > 1
        try:
            async for msg in call:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    yield msg.chunk
                elif kind == "finish":
                    yield (msg.index, msg.finish) if tagged else msg.finish
                    finishes -= 1
                    if not finishes:
                        return
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            # The decode stream also fails when the prefill side aborts the transfer: blame the cause.
            cause = _prefill_failure(prefill_task)
            if cause is None and isinstance(exc, grpc.aio.AioRpcError) and prefill_task is not None \
                    and not prefill_task.done():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(prefill_task), 0.5)
                cause = _prefill_failure(prefill_task)
            if cause is not None:
                raise self._failure(cause.rpc_error, cause.worker) from None
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._failure(exc, decode) from None

    def _abort_quietly(self, stub, request_id: str, metadata) -> None:
        """Free a reservation nobody will claim (best effort: unclaimed ones also expire)."""
        # a grpc.aio call is awaitable but not a coroutine: create_task would raise TypeError
        task = asyncio.ensure_future(stub.Abort(worker_pb2.AbortRequest(request_id=request_id), metadata=metadata))
        self._background.add(task)
        task.add_done_callback(lambda t: self._background.discard(t) or t.cancelled() or t.exception())

    def _failure(self, exc: grpc.aio.AioRpcError, worker: WorkerInfo) -> _AttemptFailed:
        error = error_from_rpc(exc)
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return _AttemptFailed(error, None, retryable=False)
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return _AttemptFailed(error, None)  # full for now, not broken
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.pool.mark_failed(worker.worker_id, self.config.failed_worker_backoff_s)
        return _AttemptFailed(error, worker)

    async def aclose(self) -> None:
        await self.channels.aclose()


def with_adapter(workers: list[WorkerInfo], lora: str) -> list[WorkerInfo]:
    """The workers that serve LoRA adapter ``lora``, those holding it in a slot only when there are
    any (a request there does not wait for the adapter to be read)."""
    serving = [w for w in workers if lora in w.loras]
    loaded = [w for w in serving if lora in w.loaded_loras]
    return loaded or serving
