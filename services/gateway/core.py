"""The gateway's core, shared by the HTTP and gRPC edges: admit a request, follow its results, let go of it.

``submit`` (in this order, so nothing is queued or charged for a request that
is refused)::

    Idempotency-Key known?  -> attach to that request (nothing else happens)
    tokenize, context check -> 400
    decode worker ready?    -> 503 + Retry-After
    queue under the limits? -> 429 + Retry-After          (cached depth)
    tenant's budgets        -> 429 + x-ratelimit-*        (takes them)
    record, claim the key   -> lost the race: attach to the winner         (Idempotency-Key only)
    greedy or seeded twin?  -> follow the identical request in flight (coalescing.py)
    enqueue                 -> 429 if the queue filled meanwhile (atomic check)

Redis is asked on the way only what must be current: the Idempotency-Key and
the tenant's budgets (when there are any), and the record and the queue entry,
written side by side (one round trip) when there is no key; a greedy or seeded
request's coalescing claim is made by the enqueue script itself, in that round trip. The worker list comes
from a view read in the background (``start``), the queue depth from one read when a request finds it
stale, in the background too (backpressure.py). A plain
request reaches the queue after its tokenization and that one round trip.

``follow`` yields the result stream's events from an entry id on, plus a
heartbeat whenever nothing arrived for ``sse_heartbeat_s`` (a queued request has
no events yet). The events come through ``ResultDelivery`` (delivery.py): one
connection reads the results of every open request of this process, so a
waiting request holds no Redis connection, and the client's Redis pool
(``--redis-max-connections``) bounds what this process opens however many
requests wait. ``detach`` runs when a client stops reading: when it left before
the terminal event and no other client is attached ``disconnect_grace_s`` later
(on any replica), the request is cancelled. A coalesced follower reads, counts
and cancels its leader's generation (``record.stream_id``), so a generation
shared by twins is cancelled only when every one of their clients has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from services.errors import (DeadlineExceededError, InvalidRequestError, ModelNotFoundError, PdserveError,
                             ServiceUnavailableError)
from services import hops
from services.gateway import metrics, prompts, tools
from services.gateway.api_keys import ApiKeys, Tenant
from services.gateway.backpressure import QueueLoad
from services.gateway.coalescing import Coalescer, Role
from services.gateway.config import GatewayConfig
from services.gateway.delivery import ResultDelivery, id_key
from services.gateway.idempotency import IdempotencyKeys, validate_key
from services.gateway.pool_wait import patiently
from services.gateway.protocol import GenerationRequest
from services.gateway.rate_limit import RateLimiter, RateStatus
from services.gateway.readiness import DecodeWorkers
from services.gateway.request_record import RequestRecord, RequestRecords, choice_records
from services.engine.structured_output import StructuredOutput
from services.gateway.response_format import GrammarCheck
from services.gateway.cached_read import CachedRead
from services.gateway.responses_format import RESPONSE
from services.gateway.served_model import ServedModel, check_cascade
from services.cascade import AUTO, CascadeSpec
from services.lora_registry import read_loras, split_model
from services.queue import AdmissionQueue, QueuedRequest, ResultReader, ResultWriter
from services.queue.admission import Admitted, Claim
from services.queue.cancel import request_cancel
from services.errors import NotFoundError
from services.queue.keys import result_stream
from services.queue.results import CHUNK, TERMINAL, decode_event

log = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"  # a pseudo event type from follow(): nothing new for a while


def _honour_cancellation() -> None:
    """Raise if this task was asked to stop: redis-py (8.1) can swallow a cancellation that lands while it
    reconnects, and a reader that never notices would follow a stream nobody reads until its deadline."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass
class Admission:
    record: RequestRecord
    tier: str
    attached: bool  # True: joined an earlier request with the same Idempotency-Key; nothing was queued
    rate: RateStatus | None = None
    coalesced: bool = False  # True: follows an identical request in flight (record.source); nothing was queued

    @property
    def request_id(self) -> str:
        return self.record.request_id


class GatewayCore:
    def __init__(self, redis, config: GatewayConfig, model: ServedModel, keys: ApiKeys | None = None,
                 more_models: tuple[ServedModel, ...] = (), cascade: CascadeSpec | None = None):
        self.redis = redis
        self.config = config
        self.model = model  # the first served model: LoRA adapters are its
        self.models = {m.name: m for m in (model, *more_models)}  # every served model by name (its pool)
        self.cascade = cascade  # model "auto" (services/cascade.py); None: not configured
        if cascade is not None:
            check_cascade(cascade, self.models)
        self.keys = keys or ApiKeys.disabled(config.default_tier)
        self.queue = AdmissionQueue(redis, config.queue_config())
        self.load = QueueLoad(self.queue, config.max_queued_requests, config.max_queued_tokens,
                              config.retry_after_s, config.depth_cache_s)
        self.workers = DecodeWorkers(redis, config.retry_after_s, config.workers_cache_s)
        self.limiter = RateLimiter(redis)
        self.idempotency = IdempotencyKeys(redis, config.idempotency_ttl_s)
        self.coalescer = Coalescer(redis, config.coalesce)
        self.grammar = GrammarCheck(model)
        # a record outlives the longest request and its result stream, so every resume finds it
        self.records = RequestRecords(redis, max(config.record_ttl_s, math.ceil(config.max_timeout_s) + 600))
        self.reader = ResultReader(redis)
        self.delivery = ResultDelivery(redis)
        self._loras = CachedRead(lambda: read_loras(redis), config.workers_cache_s * 4)
        self._known_loras: dict[str, str] = {}
        self._background: set[asyncio.Task] = set()
        self._refreshers: list[asyncio.Task] = []

    def start(self) -> None:
        """Read results, keep the worker list fresh in the background (on the serving loop); the queue depth is
        read when a request finds it stale (backpressure.py)."""
        self.delivery.start()
        if not self._refreshers:
            self._refreshers = [asyncio.get_running_loop().create_task(self.workers.keep_fresh())]

    # -- what a request asks for ------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        return self.keys.authenticate(authorization)

    def resolve_tier(self, tenant: Tenant, requested: str | None) -> str:
        """The tier asked for (``x-pdserve-priority``), but never above the tenant's own."""
        tiers = self.config.tiers
        if not requested:
            return tenant.tier
        if requested not in tiers:
            raise InvalidRequestError(f"x-pdserve-priority must be one of {list(tiers)}, got {requested[:40]!r}",
                                      param="x-pdserve-priority")
        return tiers[max(tiers.index(requested), tiers.index(tenant.tier))]

    def resolve_deadline(self, timeout: str | float | None) -> float:
        """Unix seconds by which the request must finish (``x-pdserve-timeout`` seconds from now)."""
        if timeout is None or timeout == "":
            seconds = self.config.default_timeout_s
        else:
            try:
                seconds = float(timeout)
            except ValueError:
                seconds = math.nan
            if not 0 < seconds <= self.config.max_timeout_s:  # also refuses nan
                raise InvalidRequestError(f"x-pdserve-timeout must be seconds in (0, {self.config.max_timeout_s:g}]",
                                          param="x-pdserve-timeout")
        return time.time() + seconds

    def check_model(self, name: str | None) -> ServedModel:
        """The served model whose tokenizer ``name`` uses (tokenize): adapters share their base model's,
        so their names pass too once ``resolve_model`` has checked them; ``auto`` the first tier's."""
        if not name:
            return self.model
        if name in self.models:
            return self.models[name]
        if name == AUTO:
            return self.models[self._cascade().tiers[0]]
        if split_model(name, self.model.name)[0] not in self._known_loras:
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {self._served()}",
                                     param="model")
        return self.model

    def _served(self) -> str:
        return ", ".join(repr(name) for name in self.models) + (f" and {AUTO!r}" if self.cascade else "")

    def _cascade(self) -> CascadeSpec:
        if self.cascade is None:
            raise InvalidRequestError(f"model {AUTO!r} picks a tier by cascade, but this server has no tiers "
                                      "configured (start it with --cascade SMALL,LARGE; pdserve up --cascade); "
                                      f"name a model instead: {self._served()}", param="model")
        return self.cascade

    def forget_loras(self) -> None:
        """Read the adapters again at the next request (the admin endpoint changed them)."""
        self._loras.invalidate()

    async def loras(self) -> dict[str, str]:
        """The LoRA adapters served (name -> path; services/lora_registry.py), read at most once a second."""
        self._known_loras = await self._loras.get()
        return self._known_loras

    async def resolve_model(self, name: str | None) -> tuple[str, str | None]:
        """A request's ``model`` -> (the name its responses carry, the LoRA adapter or None).
        An adapter is named as itself or as ``<base model>:<adapter>``; an unknown adapter in that
        second form is a 400 naming the ones served, any other unknown name a 404 (OpenAI's);
        ``auto`` without a cascade configured a 400."""
        if not name:
            return self.model.name, None
        if name in self.models:
            return name, None
        if name == AUTO:
            self._cascade()
            return name, None
        adapter, explicit = split_model(name, self.model.name)
        known = await self.loras()
        if adapter in known:
            return name, adapter  # responses echo the name as asked, as vLLM's do
        served = ", ".join(sorted(known)) or "none"
        if explicit:
            raise InvalidRequestError(f"unknown LoRA adapter {adapter!r}; this server serves the adapters: {served}",
                                      param="model")
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {self._served()} "
                                 f"and the LoRA adapters: {served}", param="model")

    async def listed_models(self) -> list[dict]:
        """Every served model, then ``auto`` when a cascade is configured, then the LoRA adapters (their
        ``parent`` the first model, as vLLM lists them): id, root, parent, max_model_len."""
        out = [{"id": m.name, "root": m.name, "parent": None, "max_model_len": await self.max_model_len(m)}
               for m in self.models.values()]
        if self.cascade is not None:
            lengths = {m["id"]: m["max_model_len"] for m in out}
            out.append({"id": AUTO, "root": ",".join(self.cascade.tiers), "parent": None,
                        "max_model_len": min(lengths[t] for t in self.cascade.tiers)})
        base = out[0]
        out += [{**base, "id": name, "root": path, "parent": self.model.name}
                for name, path in sorted((await self.loras()).items())]
        return out

    def _base(self, model: str, lora: str | None) -> ServedModel:
        """The served model whose pool runs a request named ``model`` (``auto``: the first tier)."""
        if model == AUTO:
            return self.models[self._cascade().tiers[0]]
        return self.model if lora is not None else self.models[model]

    async def max_model_len(self, model: ServedModel | None = None) -> int:
        """The context length of ``model`` (the first served): its decode workers' (smallest), capped by
        --max-model-len, else the model's."""
        model = model or self.model
        lengths = [n for n in (await self.workers.max_model_len(model.name), self.config.max_model_len) if n]
        return min(lengths) if lengths else model.max_model_len

    # -- admission ----------------------------------------------------------------------------

    async def submit(self, tenant: Tenant, req: GenerationRequest, *, tier: str, deadline: float,
                     idempotency_key: str | None = None, traceparent: str = "") -> Admission:
        model, lora = await self.resolve_model(req.model)
        if lora is not None:
            req.sampling["lora"] = lora
        if idempotency_key is not None:
            validate_key(idempotency_key)
            earlier = await self._attach_by_key(tenant, idempotency_key, tier)
            if earlier is not None:
                return earlier

        served = self._base(model, lora)
        token_ids = await prompts.encode(served, req.messages, req.prompt, req.tools)
        prompts.check_logit_bias(served, req.sampling)
        nested = "" if req.kind == RESPONSE else "function."  # the Responses API's tools are flat
        for i, tool in enumerate(req.tools):
            await self.grammar.check(StructuredOutput.json_schema(tool.parameters), f"tools[{i}].{nested}parameters")
        forced = tools.structured_output(req.tools, req.tool_choice) is not None
        await self.grammar.check(req.sampling.get("structured"), "tools" if forced else req.structured_param)
        max_len = await self.max_model_len(served)
        if model == AUTO:  # every tier must hold it: the smallest context of them
            max_len = min([max_len, *[await self.max_model_len(self.models[t]) for t in self.cascade.tiers[1:]]])
        prompts.check_context(len(token_ids), req.max_tokens, max_len)
        if self.config.require_ready_worker:
            await self.workers.check()
        await self.load.check(len(token_ids))
        output_budget = req.max_tokens if req.max_tokens is not None else max_len - len(token_ids)
        # every choice (best_of: every candidate) is charged its prompt and output budget, as when each
        # was a request of its own: the shared prompt saves compute, not the tenant's budget
        cost = (len(token_ids) + output_budget) * req.candidates
        rate = await self.limiter.take(tenant, cost)
        try:
            admission = await self._admit(tenant, req, token_ids, model, served.name, tier, deadline,
                                          idempotency_key, traceparent, rate)
        except Exception:
            await self.limiter.give_back(tenant, cost)  # refused after all: nothing spent
            raise
        if admission.attached:  # a concurrent retry with the same key was queued first: charged once
            await self.limiter.give_back(tenant, cost)
        return admission

    async def _admit(self, tenant: Tenant, req: GenerationRequest, token_ids: list[int], model: str, base: str,
                     tier: str, deadline: float, idempotency_key: str | None, traceparent: str,
                     rate: RateStatus | None) -> Admission:
        record = RequestRecord(self.delivery.new_request_id(), req.kind, model, int(time.time()), tenant.name, req.include_usage,
                               req.logprobs, deadline, len(token_ids),
                               tools=req.tool_choice.dumps() if req.tool_choice is not None else "")
        queued = QueuedRequest(record.request_id, tenant.name, tier, base, token_ids, req.sampling, deadline,
                               traceparent, session_key=req.session_key,
                               cascade=self.cascade.to_json() if model == AUTO else "", choices=req.candidates)
        # n > 1 is one forked generation with a result stream per choice: it coalesces with nothing
        key = self.coalescer.key(tenant.name, tier, model, token_ids, req.sampling) if req.candidates == 1 else None
        if req.candidates > 1:  # the other choices' records, before anything can be queued under their ids
            await self.records.save(*choice_records(record, req.candidates)[1:])
        if idempotency_key is None:
            if key is not None and await self._claim_and_lead(record, queued, key):
                return Admission(record, tier, attached=False, rate=rate, coalesced=True)
            if key is None:
                await self._lead(record, queued, save=True)
            return Admission(record, tier, attached=False, rate=rate)
        # with a key, the record must exist before the key names it, and the key be ours before we queue
        await self.records.save(record)
        winner = await self.idempotency.claim(tenant.name, idempotency_key, record.request_id)
        if winner != record.request_id:  # a concurrent retry got there first
            earlier = await self._attach(tenant, winner, tier)
            if earlier is not None:
                return earlier
        try:
            if key is not None and await self._coalesce(record, key):
                return Admission(record, tier, attached=False, rate=rate, coalesced=True)
            await self._lead(record, queued, save=bool(record.coalesce))  # saved again: with its key
        except Exception as exc:  # let the client retry with the same key; tell anyone attached
            await self.idempotency.release(tenant.name, idempotency_key, record.request_id)
            if isinstance(exc, PdserveError) and not record.coalesce:  # _lead told them already
                await self.queue_error(record.request_id, exc)
            raise
        return Admission(record, tier, attached=False, rate=rate)

    async def _coalesce(self, record: RequestRecord, key: str) -> bool:
        """Follow an identical request in flight (True: ``record`` is saved as its follower), or lead (False:
        ``record.coalesce`` is set, so the caller queues it holding the key) or stay alone (False)."""
        role, leader = await self.coalescer.claim(key, record.request_id, record.deadline)
        if role is Role.FOLLOW:
            record.source, record.coalesce = leader, key
            await self.records.save(record)
            metrics.count_coalesced(record.kind)
            return True
        if role is Role.LEAD:
            record.coalesce = key
        return False

    async def _claim_and_lead(self, record: RequestRecord, queued: QueuedRequest, key: str) -> bool:
        """Claim the coalescing key and queue the request in one round trip (the enqueue script does both),
        saving its record beside it: False, it leads (or, its twin's deadline being much earlier, runs alone).
        True: an identical request holds the key and ``record`` is saved as its follower; nothing was queued."""
        for _ in range(2):  # a second time after clearing a key whose leader is being cancelled
            record.coalesce = key
            claim = self.coalescer.claim_for(key, record.request_id, record.deadline)
            holder = await self._lead(record, queued, save=True, claim=claim)
            if holder is None:
                return False
            decided = await self.coalescer.judge(key, record.request_id, record.deadline, holder)
            if decided is None:
                continue
            role, leader = decided
            if role is Role.FOLLOW:
                record.source = leader
                await self.records.save(record)
                metrics.count_coalesced(record.kind)
                return True
            break
        record.coalesce = ""  # alone: computed on its own, holding no key
        await self._lead(record, queued, save=True)
        return False

    async def _lead(self, record: RequestRecord, queued: QueuedRequest, save: bool,
                    claim: Claim | None = None) -> str | None:
        """Queue a request (and save its record, with ``save``); when it leads twins and cannot be queued,
        they fail with its error (written to its result stream) and the key is let go. With ``claim``, the
        key is claimed in the enqueue: when another holds it, nothing is queued and its value is returned."""
        try:
            hops.mark(record.request_id, "gw.enqueue")
            admitted = await (self._save_and_enqueue(record, queued, claim) if save
                              else self.queue.admit(queued))
            if admitted.claimed_by is not None:
                return admitted.claimed_by
            hops.mark(record.request_id, "gw.queued")
            return None
        except Exception as exc:
            if record.coalesce:
                with contextlib.suppress(Exception):
                    await self.coalescer.release(record.coalesce, record.request_id)
                    error = exc if isinstance(exc, PdserveError) else ServiceUnavailableError(
                        f"the request could not be queued: {type(exc).__name__}")
                    await self.queue_error(record.request_id, error)
            raise

    async def _save_and_enqueue(self, record: RequestRecord, queued: QueuedRequest,
                                claim: Claim | None = None) -> Admitted:
        """The record and the queue entry in one round trip (side by side).

        Nothing reads a record before its request id is known, and without an
        Idempotency-Key the id is known only from this request's response, so
        the two writes need no order. A request queued whose record could not be
        written is cancelled: its client gets the error and could never resume it.
        """
        saved, queued_or_error = await asyncio.gather(self.records.save(record), self.queue.admit(queued, claim=claim),
                                                      return_exceptions=True)
        if isinstance(queued_or_error, BaseException):
            raise queued_or_error
        if isinstance(saved, BaseException):
            with contextlib.suppress(Exception):
                await request_cancel(self.redis, record.request_id)
            raise saved
        return queued_or_error

    async def _attach_by_key(self, tenant: Tenant, key: str, tier: str) -> Admission | None:
        request_id = await self.idempotency.lookup(tenant.name, key)
        return None if request_id is None else await self._attach(tenant, request_id, tier)

    async def _attach(self, tenant: Tenant, request_id: str, tier: str) -> Admission | None:
        record = await self.records.load(request_id)
        if record is None or record.tenant != tenant.name:
            return None
        return Admission(record, tier, attached=True)

    async def queue_error(self, request_id: str, exc: PdserveError) -> None:
        """Write ``exc`` as the request's error event (for clients attached through its Idempotency-Key)."""
        await ResultWriter(self.redis, self.queue.config.result_ttl_s).error(request_id, exc.code, exc.message,
                                                                              exc.http_status)

    async def find(self, tenant: Tenant, request_id: str) -> RequestRecord:
        """A request of this tenant (for resuming), or NotFoundError: another tenant's is not found either."""
        record = await self.records.load(request_id) if len(request_id) <= 128 else None
        if record is None or record.tenant != tenant.name:
            raise NotFoundError(f"no request {request_id[:128]!r} (it expired, or was never made)", param="request_id")
        return record

    # -- results ------------------------------------------------------------------------------

    async def follow(self, record: RequestRecord, last_id: str = "0",
                     direct: Callable[[tuple[str, str, Any]], bool] | None = None
                     ) -> AsyncIterator[tuple[str, str, Any]]:
        """``(entry_id, type, data)`` after ``last_id`` up to the terminal event, with heartbeats between.

        ``direct``, when given, is offered each event that arrives while this generator waits with nothing in
        hand; an event it takes (returns True) is not yielded (direct_write.py)."""
        rid = record.stream_id  # a coalesced follower reads its leader's results
        give_up = self._give_up(record)
        if id_key(last_id) != (0, 0):  # resuming after the terminal event: nothing is left (a fresh stream,
            # from 0-0, asks Redis nothing here: its subscription's catch-up reads whatever is there already)
            last = await self.reader.last_event(rid)
            if last is not None and last[1] in TERMINAL and id_key(last[0]) <= id_key(last_id):
                return
        async with self.delivery.subscribe(rid, last_id, until=give_up) as sub:
            sub.sink = direct
            while True:
                _honour_cancellation()
                wait = min(self.config.sse_heartbeat_s, give_up - time.time())
                if wait <= 0:
                    raise DeadlineExceededError(f"request {rid} got no result before its deadline")
                sunk = sub.sunk
                events = await sub.next(wait)
                if not events and sub.sunk != sunk:  # chunks went straight out meanwhile: not quiet
                    continue
                exists, status = True, None
                if not events:  # quiet for a while: anything the delivery stream missed, and is it still there?
                    exists, status = await patiently(lambda: self.delivery.quiet_check(sub), give_up)
                    events = await sub.next(0)
                for entry_id, kind, data in events:
                    if kind in TERMINAL and record.coalesce:  # done: later twins are computed afresh
                        self.spawn(self._release_key(record))
                    yield entry_id, kind, data
                    if kind in TERMINAL:
                        return
                if events:
                    continue
                if not exists and status != "queued":
                    raise NotFoundError(f"the results of request {rid} expired (or it was never queued)")
                yield "", HEARTBEAT, None

    def _give_up(self, record: RequestRecord) -> float:
        """When a client of ``record`` stops waiting for results (and for a busy pool: pool_wait.py)."""
        deadline = record.deadline or time.time() + self.config.default_timeout_s
        return deadline + self.config.deadline_grace_s

    async def text_before(self, request_id: str, last_id: str) -> int:
        """Characters of output up to and including ``last_id`` (completions' logprobs text_offset on resume)."""
        if last_id == "0":
            return 0
        total = 0
        for _, fields in await self.redis.xrange(result_stream(request_id), "-", last_id):
            kind, data = decode_event(fields)
            if kind == CHUNK:
                total += len(data.get("text") or "")
        return total

    # -- clients coming and going ---------------------------------------------------------------

    async def attach(self, record: RequestRecord) -> None:
        """Count a client reading the request (on the record of the generation it shares, for a follower)."""
        if not record.source:  # queued already: a busy pool is waited out (pool_wait.py)
            await patiently(lambda: self.records.add_reader(record.request_id, 1), self._give_up(record))
        elif not await patiently(lambda: self.records.join(record.source), self._give_up(record)):
            raise ServiceUnavailableError(f"the identical request {record.source} that this one shares was "
                                          "cancelled (all its clients left) as this one joined; send it again")

    def detach(self, record: RequestRecord, counted: bool, finished: bool) -> None:
        """A client stopped reading (done, or gone: then maybe cancel). Safe to call from a cancelled task."""
        self.spawn(self._detach(record, counted, finished))

    async def _detach(self, record: RequestRecord, counted: bool, finished: bool) -> None:
        generation = record.stream_id
        try:
            if counted:
                await patiently(lambda: self.records.add_reader(generation, -1), self._give_up(record))
            if finished:
                return
            if self.config.disconnect_grace_s:
                await asyncio.sleep(self.config.disconnect_grace_s)  # time to resume before we give up on it
            last = await self.reader.last_event(generation)
            if last is not None and last[1] in TERMINAL:
                return
            if not await self.records.mark_cancelled(generation):  # someone reads it: a twin, or a resume
                return
            if record.coalesce:
                await self.coalescer.release(record.coalesce, generation)
            log.info("request %s: its clients left; cancelling", generation)
            await request_cancel(self.redis, generation)
        except Exception as exc:
            log.warning("request %s: detaching failed: %s", record.request_id, exc)

    async def _release_key(self, record: RequestRecord) -> None:
        try:
            await patiently(lambda: self.coalescer.release(record.coalesce, record.stream_id),
                            self._give_up(record))
        except Exception as exc:  # its TTL ends it anyway
            log.warning("request %s: releasing its coalescing key failed: %s", record.request_id, exc)

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` on its own (outlives a cancelled request task); kept referenced until done."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- health -----------------------------------------------------------------------------------

    async def readiness(self) -> tuple[bool, str, int]:
        """(ready, why not, ready decode workers): Redis answers and a decode worker is ready."""
        try:
            await self.redis.ping()
            workers = await self.workers.ready()
        except Exception as exc:
            return False, f"redis unreachable: {type(exc).__name__}: {exc}", 0
        if not workers:
            return False, "no ready decode worker", 0
        return True, "", len(workers)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Let pending detaches (cancels) finish, then stop."""
        await self.delivery.close()
        self.workers.stop()
        for task in self._refreshers:
            task.cancel()
        await asyncio.gather(*self._refreshers, return_exceptions=True)
        self._refreshers = []
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)
        for task in list(self._background):
            task.cancel()


__all__ = ["HEARTBEAT", "Admission", "GatewayCore"]
