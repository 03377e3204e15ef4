"""The public gRPC Generation API on the gateway: the same admission and results as HTTP, over the queue.

Metadata plays the HTTP headers' part: ``authorization: Bearer <key>``,
``x-pdserve-priority`` (a tier name). ``GenerateRequest.priority`` > 0 moves
the request that many tiers below the key's (never above). The call's gRPC
deadline is the request's deadline. ``request_id``, when the caller sets one, is
its idempotency key: a retried call with the same id attaches to the original
request instead of running it twice (n = 1 only: with n > 1 a retried call runs afresh). ``n`` > 1
and ``best_of`` are choices.py's child requests, every message tagged with its choice ``index``,
then one ``usage`` message with the prompt counted once. A cancelled call cancels the request (after
the same grace period as an HTTP disconnect, within which a retry may attach).

Errors: refusals before queueing map through ``grpc_codec.status_of``; an
error event from the result stream maps by its HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services import telemetry
from services.errors import InvalidRequestError
from services.gateway import choices, metrics, prompts, protocol
from services.gateway.core import HEARTBEAT, GatewayCore
from services.gateway.http_errors import as_pdserve
from services.gateway.protocol import GenerationRequest
from services.gateway.request_record import CHAT, COMPLETION
from services.grpc_codec import abort_with, append_chunk, sampling_from_proto
from services.grpc_decode import add_servicer
from services.queue.results import CHUNK, ERROR, FINAL
from services.session_key import HEADER, session_key_of

_STATUS_BY_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                   403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                   413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                   499: grpc.StatusCode.CANCELLED, 502: grpc.StatusCode.UNAVAILABLE,
                   503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def event_status(data: dict) -> tuple[grpc.StatusCode, str]:
    """An error event -> (gRPC status, message), by the event's HTTP status."""
    status = data.get("status")
    code = _STATUS_BY_HTTP.get(status, grpc.StatusCode.INTERNAL) if type(status) is int else grpc.StatusCode.INTERNAL
    return code, f"{data.get('code', 'internal_error')}: {data.get('message', 'the request failed')}"


def _metadata(context) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def token_chunk(data: dict) -> common_pb2.TokenChunk:
    chunk = common_pb2.TokenChunk(token_ids=data.get("token_ids") or [], text=data.get("text") or "")
    for e in data.get("logprobs") or []:
        chunk.logprobs.append(common_pb2.TokenLogprob(
            token_id=e.get("token_id", 0), logprob=e.get("logprob", 0.0), token=e.get("token", ""),
            top=[common_pb2.TopLogprob(token_id=t.get("token_id", 0), logprob=t.get("logprob", 0.0),
                                       token=t.get("token", "")) for t in e.get("top") or []]))
    return chunk


def finish_message(data: dict) -> common_pb2.Finish:
    usage, timings = data.get("usage") or {}, data.get("timings") or {}
    return common_pb2.Finish(
        finish_reason=data.get("finish_reason") or "stop",
        usage=common_pb2.Usage(prompt_tokens=usage.get("prompt_tokens", 0),
                               completion_tokens=usage.get("completion_tokens", 0),
                               cached_prompt_tokens=usage.get("cached_prompt_tokens", 0)),
        timings=common_pb2.Timings(**{k: float(timings[k]) for k in ("ttft_ms", "e2e_ms", "queue_ms", "prefill_ms")
                                      if isinstance(timings.get(k), (int, float))}),
        prefill_worker=str(data.get("prefill_worker") or ""), decode_worker=str(data.get("decode_worker") or ""))


class GatewayGenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    def _generation_request(self, request) -> GenerationRequest:
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError("give a prompt: text, chat or token_ids", param="input")
        params = sampling_from_proto(request.sampling)  # validates; InvalidRequestError names the field
        max_n = self.core.config.max_n
        n = protocol.check_n(request.n if request.HasField("n") else 1, max_n)
        stream = not request.HasField("stream") or request.stream
        best_of = protocol.check_best_of(request.best_of if request.HasField("best_of") else None, n, stream, max_n)
        sampling = dataclasses.asdict(params)
        common = {"model": request.model or None, "sampling": sampling, "stream": stream, "n": n,
                  "best_of": best_of, "hide_logprobs": protocol.ask_logprobs_to_rank(sampling, best_of),
                  "logprobs": params.logprobs, "structured_param": "sampling.structured"}
        if kind == "chat":
            messages = protocol.parse_messages([{"role": m.role, "content": m.content}
                                                for m in request.chat.messages])
            return GenerationRequest(CHAT, messages=messages, **common)
        if kind == "text":
            return GenerationRequest(COMPLETION, prompt=protocol.parse_prompt(request.text), **common)
        return GenerationRequest(COMPLETION, prompt=protocol.parse_prompt(list(request.token_ids.ids)), **common)

    def _tier(self, tenant, metadata: dict[str, str], priority: int) -> str:
        if metadata.get("x-pdserve-priority"):
            return self.core.resolve_tier(tenant, metadata["x-pdserve-priority"])
        tiers = self.core.config.tiers
        return tiers[min(len(tiers) - 1, tiers.index(tenant.tier) + max(0, priority))]

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        core = self.core
        started = time.perf_counter()
        rid = counted = None
        finished = False
        outcome = "aborted"
        with telemetry.server_span("gateway.generate", context, request_id=request.request_id or None):
            try:
                md = _metadata(context)
                tenant = core.authenticate(md.get("authorization"))
                req = self._generation_request(request)
                req.session_key = session_key_of(request.session_key, md.get(HEADER), "session_key")
                tier = self._tier(tenant, md, request.priority)
                remaining = context.time_remaining()
                deadline = time.time() + remaining if remaining else core.resolve_deadline(md.get("x-pdserve-timeout"))
                traceparent = telemetry.inject_carrier().get("traceparent", "")
                if req.candidates > 1:
                    outcome = None  # counted by _choices
                    first = await core.submit(tenant, req, tier=tier, deadline=deadline, traceparent=traceparent)
                    records = choices.records_of(req, first)
                    async for reply in self._choices(context, req, records, request.request_id or first.request_id):
                        yield reply
                    return
                admission = await core.submit(tenant, req, tier=tier, deadline=deadline,
                                              idempotency_key=request.request_id or None, traceparent=traceparent)
                rid = admission.request_id
                admitted = time.perf_counter()
                first_at = None
                reply_id = request.request_id or rid
                await core.attach(admission.record)
                counted = True
                stream = req.stream
                merged = common_pb2.TokenChunk()
                first = True
                events = core.follow(admission.record, "0")
                async with contextlib.aclosing(events):
                    async for _, kind, data in events:
                        if kind == HEARTBEAT:
                            continue
                        if kind == CHUNK:
                            if first and not admission.attached:
                                first_at = time.perf_counter()
                                metrics.observe_ttft(first_at - started)
                            first = False
                            chunk = token_chunk(data)
                            if stream:
                                yield generate_pb2.GenerateResponse(chunk=chunk, request_id=reply_id)
                            else:
                                append_chunk(merged, chunk)
                        elif kind == FINAL:
                            finished = True
                            outcome = "aborted" if data.get("finish_reason") == "abort" else "ok"
                            if not stream:
                                yield generate_pb2.GenerateResponse(chunk=merged, request_id=reply_id)
                            yield generate_pb2.GenerateResponse(finish=finish_message(data), request_id=reply_id)
                            if outcome == "ok" and not admission.attached:
                                metrics.observe_phases(started, admitted, first_at, time.perf_counter(), data)
                        elif kind == ERROR:
                            finished = True
                            outcome = "error"
                            code, message = event_status(data)
                            await context.abort(code, message)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise  # the client went away (detached below: cancelled after the grace period), or aborted
            except Exception as exc:
                outcome = metrics.outcome_of(exc)
                await abort_with(context, as_pdserve(exc))  # Redis trouble is UNAVAILABLE, not INTERNAL
            finally:
                if outcome is not None:
                    metrics.count("grpc", outcome)
                if rid is not None:
                    core.detach(admission.record, bool(counted), finished)

    async def _choices(self, context, req: GenerationRequest, records: list, reply_id: str):
        """n > 1 or best_of (choices.py's children): streamed, every choice's chunks as they come and its
        Finish, each tagged with its index; else per choice in index order (best_of: the n likeliest) one
        chunk and its Finish. Then the request's usage, the prompt once. One choice failing ends the call
        with its status, and the call ending early cancels every choice."""
        core = self.core
        counted = finished = False
        outcome = "aborted"
        try:
            await choices.attach_all(core, records)
            counted = True
            merged = [common_pb2.TokenChunk() for _ in records]
            finals: list[dict] = [{} for _ in records]
            async with contextlib.aclosing(choices.interleave(core, records)) as events:
                async for i, kind, data in events:
                    if kind == CHUNK and req.stream:
                        yield generate_pb2.GenerateResponse(chunk=token_chunk(data), request_id=reply_id, index=i)
                    elif kind == CHUNK:
                        append_chunk(merged[i], token_chunk(data))
                    elif kind == FINAL:
                        finals[i] = data
                        if req.stream:
                            yield generate_pb2.GenerateResponse(finish=finish_message(data), request_id=reply_id,
                                                                index=i)
                    elif kind == ERROR:
                        outcome = "error"
                        code, message = event_status(data) if data is not None else (
                            grpc.StatusCode.UNAVAILABLE, "its result stream ended without a final event")
                        await context.abort(code, f"choice {i}: {message}")
            finished = True
            outcome = "aborted" if any(f.get("finish_reason") == "abort" for f in finals) else "ok"
            if not req.stream:
                order = list(range(len(records)))
                if req.best_of:
                    order = choices.best(order, req.n, lambda k: sum(lp.logprob for lp in merged[k].logprobs))
                for index, k in enumerate(order):
                    if req.hide_logprobs:
                        del merged[k].logprobs[:]
                    yield generate_pb2.GenerateResponse(chunk=merged[k], request_id=reply_id, index=index)
                    yield generate_pb2.GenerateResponse(finish=finish_message(finals[k]), request_id=reply_id,
                                                        index=index)
            total = choices.sum_usage([{"prompt_tokens": 0, "completion_tokens": 0, **(f.get("usage") or {})}
                                       for f in finals])
            yield generate_pb2.GenerateResponse(request_id=reply_id, usage=common_pb2.Usage(
                prompt_tokens=total["prompt_tokens"], completion_tokens=total["completion_tokens"],
                cached_prompt_tokens=total.get("cached_prompt_tokens", 0)))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            outcome = metrics.outcome_of(exc)
            await abort_with(context, as_pdserve(exc))
        finally:
            metrics.count("grpc", outcome)
            if counted:  # else attach_all let go of them already
                for record in records:
                    core.detach(record, True, finished)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context):
        try:
            self.core.authenticate(_metadata(context).get("authorization"))
            served = self.core.check_model(request.model or None)
            kind = request.WhichOneof("input")
            if kind == "chat":
                messages = protocol.parse_messages([{"role": m.role, "content": m.content}
                                                    for m in request.chat.messages])
                ids = await prompts.encode(served, messages=messages)
            elif kind == "text":
                ids = await prompts.encode(served, prompt=protocol.parse_prompt(request.text))
            else:
                raise InvalidRequestError("give a prompt: text or chat", param="input")
            max_len = await self.core.max_model_len(served)
        except Exception as exc:
            await abort_with(context, exc)
        return generate_pb2.TokenizeResponse(token_ids=ids, max_model_len=max_len)

    async def ListModels(self, request, context):
        try:
            self.core.authenticate(_metadata(context).get("authorization"))
            listed = await self.core.listed_models()
        except Exception as exc:
            await abort_with(context, exc)
        return generate_pb2.ListModelsResponse(models=[
            generate_pb2.Model(id=m["id"], max_model_len=m["max_model_len"], parent=m["parent"] or "") for m in listed])


async def start_grpc(core: GatewayCore, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve Generation (and gRPC health, SERVING) on ``host:port`` (0: a free port); returns the bound port."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    add_servicer(server, GatewayGenerationServicer(core), generate_pb2_grpc.add_GenerationServicer_to_server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot listen on {host}:{port} for gRPC")
    await server.start()
    for name in ("", "pdserve.v1.Generation"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
