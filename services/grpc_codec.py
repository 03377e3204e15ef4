"""Conversions between the protos and the engine's plain types (no torch), and errors -> gRPC status.

The edges (servicers) call these and nothing else converts, so a field means
the same thing at every hop.
"""

from __future__ import annotations

import time
from typing import Callable

import grpc

from proto.pdserve.v1 import common_pb2, worker_pb2
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.structured_output import StructuredOutput
from services.errors import DeadlineExceededError, InvalidRequestError, PdserveError, is_described

_OPTIONAL_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields keep SamplingParams' defaults; values are validated there (InvalidRequestError)."""
    kwargs: dict = {name: getattr(msg, name) for name in _OPTIONAL_FLOATS if msg.HasField(name)}
    if msg.HasField("max_tokens"):
        kwargs["max_tokens"] = msg.max_tokens or None  # 0: until the context is full
    for name in ("top_k", "seed", "logprobs", "skip_special_tokens"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    if msg.HasField("lora"):
        kwargs["lora"] = msg.lora
    kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured"):
        s = msg.structured
        try:
            kwargs["structured"] = StructuredOutput(s.kind, s.spec, tuple(s.replay))
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"sampling.structured: {exc.message}", param="sampling.structured") from None
    return SamplingParams(**kwargs)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens or 0, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens, logit_bias=params.logit_bias)
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.lora is not None:
        msg.lora = params.lora
    if params.structured is not None:
        s = params.structured
        msg.structured.CopyFrom(common_pb2.StructuredOutput(kind=s.kind, spec=s.spec, replay=s.replay))
    return msg


def worker_request(request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0,
                   deadline: float = 0.0, results_to: str = "") -> worker_pb2.WorkerRequest:
    return worker_pb2.WorkerRequest(request_id=request_id, token_ids=token_ids, sampling=sampling_to_proto(params),
                                    priority=priority, deadline=deadline, results_to=results_to)


def check_deadline(deadline: float) -> None:
    if deadline and time.time() > deadline:
        raise DeadlineExceededError("the request's deadline passed before this hop")


def chunk_from_output(out: RequestOutput, token_text: Callable[[int], str] | None = None) -> common_pb2.TokenChunk:
    chunk = common_pb2.TokenChunk(token_ids=out.new_token_ids, text=out.new_text)
    for lp in out.logprobs or []:
        if lp is None:
            continue
        text = token_text or (lambda _t: "")
        chunk.logprobs.append(common_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, token=text(lp.token_id),
            top=[common_pb2.TopLogprob(token_id=t, logprob=p, token=text(t)) for t, p in lp.top]))
    return chunk


def load_message(stats: dict) -> worker_pb2.WorkerLoad:
    """A worker's load (``WorkerRuntime.load()``) as the GetLoad answer; prefill and decode send the same."""
    return worker_pb2.WorkerLoad(
        num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
        queued_prefill_tokens=int(stats.get("queued_prefill_tokens", 0)),
        kv_blocks_total=int(stats.get("kv_blocks_total", 0)), kv_blocks_used=int(stats.get("kv_blocks_used", 0)),
        prefix_cache_queries=int(stats.get("prefix_cache_queries", 0)),
        prefix_cache_hits=int(stats.get("prefix_cache_hits", 0)),
        num_preemptions=int(stats.get("num_preemptions", 0)), draining=bool(stats.get("draining")))


def append_chunk(merged: common_pb2.TokenChunk, chunk: common_pb2.TokenChunk) -> None:
    """A non-streamed reply is one chunk: every token, its text and its logprobs, in order."""
    merged.token_ids.extend(chunk.token_ids)
    merged.text += chunk.text
    merged.logprobs.extend(chunk.logprobs)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status an error is answered with (unknown errors are INTERNAL, with their message).

    A pdserve error, or one raised below ``services`` that names its status the same way
    (``kvtransfer.TransferError``: kvtransfer imports nothing from services).
    """
    if is_described(exc):
        return getattr(grpc.StatusCode, exc.grpc_status), exc.message
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_of(exc)
    await context.abort(code, message)


def error_from_rpc(exc: grpc.aio.AioRpcError) -> PdserveError:
    """A worker's gRPC error -> the same pdserve error, so the router can answer its caller alike."""
    from services import errors

    by_code = {
        grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequestError,
        grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityError,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
        grpc.StatusCode.CANCELLED: errors.RequestAbortedError,
        grpc.StatusCode.NOT_FOUND: errors.ModelNotFoundError,
    }
    cls = by_code.get(exc.code(), errors.TransferError if exc.code() == grpc.StatusCode.UNAVAILABLE else PdserveError)
    return cls(exc.details() or exc.code().name)


__all__ = [
    "DeadlineExceededError", "InvalidRequestError", "abort_with", "append_chunk", "check_deadline", "chunk_from_output",
    "error_from_rpc", "load_message", "sampling_from_proto", "sampling_to_proto", "status_of", "worker_request",
]
