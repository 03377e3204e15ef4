"""The decode-first hand-off between two engines over kvtransfer.

Decode side::

    owner = EngineBlockOwner(async_engine)
    receiver = Receiver(engine.kv_cache, engine.namespace, owner)
    pending = await reserve_for_transfer(async_engine, owner, receiver, rid, prompt, params, timeout_s)
    ...give pending.descriptor.to_bytes() to the prefill side...
    async for out in decode_after_transfer(async_engine, rid, await pending): ...

Prefill side::

    result = await prefill_and_send(async_engine, sender, descriptor, prompt, params)

Ownership: the decode engine's blocks are reserved on its engine thread before
the receiver learns of them; if the transfer fails, the receiver calls
``owner.release`` and the reservation is released on the engine thread. On the
prefill side, full blocks are sent as soon as their chunk is computed (they are
never written again), the rest (the last partial block included) with the
first token in one message; the prefill-only request's blocks are released
when the call ends, on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass

from kvtransfer import Completion, PendingTransfer, Receiver, Sender, TransferDescriptor
from services.engine.async_engine import AsyncEngine
from services.engine.outputs import RequestOutput, TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services import phases
from services.errors import InvalidRequestError, TransferError


def parse_descriptor(data: bytes, transfer_id: str) -> TransferDescriptor:
    """A descriptor from a peer's message, for ``transfer_id``; InvalidRequestError when it is not."""
    try:
        desc = TransferDescriptor.from_bytes(data)
    except Exception as exc:
        raise InvalidRequestError(f"bad descriptor: {exc}", param="descriptor") from None
    if desc.transfer_id != transfer_id:
        raise InvalidRequestError(f"descriptor is for {desc.transfer_id!r}, not {transfer_id!r}", param="descriptor")
    return desc


class EngineBlockOwner:
    """kvtransfer's BlockOwner over an engine whose reservations are made ahead, on its thread."""

    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine
        self._ready: dict[str, list[int]] = {}

    async def prepare(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0) -> int:
        engine = self.async_engine.engine
        reserved = False  # set on the engine thread: the reservation exists

        def reserve() -> list[int]:
            nonlocal reserved
            blocks = engine.reserve(request_id, prompt, params, priority)
            reserved = True
            return blocks

        try:
            blocks = await self.async_engine.call(reserve)
        except asyncio.CancelledError:
            # the caller left (its Reserve call was cancelled) while the engine thread reserved: nobody
            # will hold the reservation, so give it back; queued after the reserve, it runs after it
            self.async_engine.submit(lambda: reserved and engine.release(request_id))
            raise
        self._ready[request_id] = blocks
        return len(blocks)

    def reserve(self, transfer_id: str, num_blocks: int) -> Sequence[int]:
        return self._ready.pop(transfer_id)

    def release(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        self._ready.pop(transfer_id, None)
        engine = self.async_engine.engine
        self.async_engine.submit(lambda: engine.release(transfer_id))


async def reserve_for_transfer(async_engine: AsyncEngine, owner: EngineBlockOwner, receiver: Receiver,
                               request_id: str, prompt: list[int], params: SamplingParams,
                               timeout_s: float, priority: int = 0) -> PendingTransfer:
    """Reserve blocks for the prompt (CapacityError if there is no room) and expect its KV."""
    num_blocks = await owner.prepare(request_id, prompt, params, priority)
    try:
        return receiver.reserve(request_id, num_blocks, timeout_s)
    except BaseException:
        owner.release(request_id, ())
        raise


async def decode_after_transfer(async_engine: AsyncEngine, request_id: str, completion: Completion,
                                choices: list[tuple[str, SamplingParams]] = ()) -> AsyncIterator[RequestOutput]:
    """The reserved blocks hold the prompt's KV: decode from the first token, streaming outputs (with
    ``choices``, the other choices' too: forked off that KV with the first tokens the prefill side sent)."""
    engine = async_engine.engine
    logprobs = completion.meta.get("first_logprobs")
    first_logprobs = TokenLogprobs.from_json(logprobs) if logprobs else None
    firsts = completion.meta.get("choices") or []
    if len(firsts) != len(choices):
        raise TransferError(f"{request_id}: the prefill side sent {len(firsts)} choices' first tokens, "
                            f"expected {len(choices)}")
    forked = [(cid, p, token, TokenLogprobs.from_json(lp) if lp else None)
              for (cid, p), (token, lp) in zip(choices, firsts)]
    stream = async_engine.stream_many(
        [request_id, *(c for c, _ in choices)],
        lambda: engine.start_decode(request_id, completion.first_token, first_logprobs, choices=forked))
    async with contextlib.aclosing(stream):
        async for out in stream:
            yield out


@dataclass(frozen=True)
class PrefillResult:
    first_token: int  # the receiver got it with the final message too
    num_cached_tokens: int  # prompt tokens this engine's prefix cache served


async def prefill_and_send(async_engine: AsyncEngine, sender: Sender,
                           target: TransferDescriptor | Awaitable[TransferDescriptor], prompt: list[int],
                           params: SamplingParams, priority: int = 0, request_id: str | None = None,
                           choices: list[tuple[str, SamplingParams]] = ()) -> PrefillResult:
    """Prefill ``prompt`` and write its KV into the descriptor's blocks as chunks finish.

    ``choices``: the request's other choices (request id, params): the prompt is computed once
    (``add_choices(prefill_only=True)``) and each choice's first token, sampled here from the same
    logits row, travels with the last blocks (``meta["choices"]``: [token, logprobs or None] each),
    for the decode side's ``start_decode(..., choices=)``.

    ``target``: the descriptor, or an awaitable of it while the decode side is still
    reserving (then ``request_id`` names the request): computing starts at once and
    the first KV send waits for it. Raises TransferError (after aborting the
    transfer) if anything fails, or what awaiting ``target`` raised.
    """
    desc = target if isinstance(target, TransferDescriptor) else None
    rid = desc.transfer_id if desc is not None else request_id
    if rid is None:
        raise ValueError("prefill_and_send needs request_id while the descriptor is pending")
    engine = async_engine.engine
    block_size = engine.config.block_size
    sent = 0
    prefilled = False
    waited = 0.0  # awaiting the decode side's descriptor and the KV sends (compute goes on meanwhile)
    try:
        # closed on every exit, so a prefill left behind (the decode side's reservation failed, the
        # call was cancelled) is aborted and its blocks freed now, not whenever the GC collects the
        # stream: an idle worker may not collect it for a long time (a chaos run saw 14 blocks held)
        if choices:
            ids, every = [rid, *(c for c, _ in choices)], [params, *(p for _, p in choices)]
            stream = async_engine.stream_many(ids, lambda: engine.add_choices(ids, prompt, every, priority,
                                                                              prefill_only=True))
        else:
            stream = async_engine.generate(prompt, params, request_id=rid, priority=priority, prefill_only=True)
        firsts: dict[str, list] = {}  # a choice's [first token, its logprobs as JSON or None]
        async with contextlib.aclosing(stream):
            async for out in stream:
                if out.request_id != rid:  # a choice's first token (it holds no blocks: choice 0's are sent)
                    if out.finish_reason != "prefilled":
                        raise TransferError(f"choice {out.request_id} of {rid} ended early: {out.finish_reason}")
                    lp = out.logprobs[0] if out.logprobs else None
                    firsts[out.request_id] = [out.new_token_ids[0], lp.to_json() if lp is not None else None]
                    continue
                if out.finished and out.finish_reason != "prefilled":
                    raise TransferError(f"prefill of {rid} ended early: {out.finish_reason}")
                prefilled = out.finished  # from here its blocks are held until released (finally)
                blocks = out.block_ids or []
                ready = len(blocks) if out.finished else min(out.num_computed_tokens, len(prompt)) // block_size
                if not out.finished and ready == sent:
                    continue
                if desc is None:
                    waited_from = time.perf_counter()
                    desc = await target
                    waited += time.perf_counter() - waited_from
                    if desc.transfer_id != rid:
                        raise TransferError(f"descriptor is for {desc.transfer_id!r}, not {rid!r}")
                if len(blocks) != desc.num_blocks and out.finished:
                    raise TransferError(f"prefill of {rid} holds {len(blocks)} blocks, the receiver reserved "
                                        f"{desc.num_blocks}")
                if out.finished:  # the last blocks and the first token go in one message
                    first = out.new_token_ids[0]
                    # the first token's logprobs travel with it: the decode side reports that token
                    logprobs = out.logprobs[0] if out.logprobs else None
                    meta = {"first_logprobs": logprobs.to_json()} if logprobs is not None else None
                    if choices:  # sampled in the step that finished choice 0's prompt: all here by now
                        missing = [c for c, _ in choices if c not in firsts]
                        if missing:
                            raise TransferError(f"choices {missing} of {rid} have no first token")
                        meta = {**(meta or {}), "choices": [firsts[c] for c, _ in choices]}
                    waited_from = time.perf_counter()
                    await sender.finish(desc, first, meta, blocks=blocks[sent:ready], dst_offset=sent)
                    waited += time.perf_counter() - waited_from
                    return PrefillResult(first, out.num_cached_tokens)
                waited_from = time.perf_counter()
                await sender.send_blocks(desc, blocks[sent:ready], dst_offset=sent)
                waited += time.perf_counter() - waited_from
                sent = ready
        raise TransferError(f"prefill of {rid} produced no result")
    except BaseException as exc:
        if desc is not None:
            await asyncio.shield(sender.abort(desc, f"prefill side failed: {exc}"))
        raise
    finally:
        # one observation per request: the time this call waited on the descriptor and the sends
        phases.observe("kv_transfer_wait", waited, role=async_engine.role)
        # a finished prefill-only request holds its blocks until released; an unfinished
        # one was aborted (and freed) when its stream closed
        if prefilled:
            async_engine.submit(lambda: engine.release(rid))
