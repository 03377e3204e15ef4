"""Peer fetch: a prefill worker pulls a prompt's leading blocks from the worker that holds them.

The router's cost model (``services/router/fetch_cost.py``) sends a prompt to the worker where
load is best and names the peer holding its prefix (``PrefillRequest.fetch``). Puller::

    outcome = await fetch_prefix(async_engine, owner, receiver, holder_stub, fetch_id, prompt, n, timeout_s)
    ...then prefill the prompt as usual: the fetched blocks are prefix-cache hits...

Holder (the ``Fetch`` RPC)::

    result = await serve_fetch(async_engine, sender, descriptor, prefix_tokens)

It is the decode-first hand-off (``services/handoff.py``) with the roles moved, over the same
code and the same ownership rules: the puller reserves blocks on its engine thread
(``EngineBlockOwner``) and its ``Receiver`` releases them on a failed, timed-out or cancelled
transfer; the holder runs the prefix as a prefill-only request (``prefill_and_send``), so its
blocks, found in its pool or copied back from its spill tier and checked against the prefix's
tokens as every hit is, are pinned while they are sent and released on every exit. The puller
hashes the received blocks from its own copy of the tokens into its prefix cache
(``Engine.adopt_fetched``); each chunk's checksum was verified where it landed. Any failure (the
holder gone or refusing, a timeout, a corrupted chunk, no room) leaves nothing held on either
side, and the puller computes the prefix instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvtransfer import Receiver, Sender
from services import telemetry
from services.engine.async_engine import AsyncEngine
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError, NotFoundError
from services.handoff import (EngineBlockOwner, PrefillResult, parse_descriptor, prefill_and_send,
                              reserve_for_transfer)

log = logging.getLogger(__name__)

# The holder's prefill of the prefix runs ahead of its waiting requests (lower runs first): the
# puller's request waits on it, and it computes at most the prefix's last block.
FETCH_PRIORITY = -1
_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class FetchOutcome:
    blocks: int  # blocks now cached here from the peer (0: nothing fetched)
    nbytes: int
    seconds: float
    error: str = ""  # why the fetch failed ("" when it did not); the blocks are computed instead


async def fetch_prefix(async_engine: AsyncEngine, owner: EngineBlockOwner, receiver: Receiver, holder_stub,
                       fetch_id: str, prompt: list[int], num_blocks: int, timeout_s: float,
                       worker_id: str = "") -> FetchOutcome:
    """Pull the first ``num_blocks`` blocks of ``prompt`` from the holder behind ``holder_stub``
    (a PrefillWorker stub) into this engine's prefix cache. Never raises for a failed fetch:
    the outcome says what happened, and nothing is left held."""
    from proto.pdserve.v1 import worker_pb2

    engine = async_engine.engine
    bs = engine.config.block_size
    num_blocks = min(num_blocks, len(prompt) // bs)
    prefix = prompt[:num_blocks * bs]
    started = time.perf_counter()
    if num_blocks < 1 or await async_engine.call(lambda: engine.held_prefix_blocks(prefix)) >= num_blocks:
        return FetchOutcome(0, 0, 0.0)  # nothing to fetch: it is here already
    pending = None
    arrived = False  # the KV is in the reserved blocks: the reservation is ours to release, not the receiver's
    labels = (async_engine.role, worker_id)
    try:
        pending = await reserve_for_transfer(async_engine, owner, receiver, fetch_id, prefix, _PARAMS, timeout_s)
        await holder_stub.Fetch(worker_pb2.FetchRequest(fetch_id=fetch_id, token_ids=prefix,
                                                        descriptor=pending.descriptor.to_bytes()), timeout=timeout_s)
        await asyncio.wait_for(_arrival(pending), timeout_s)
        arrived = True
        cached = await async_engine.call(lambda: engine.adopt_fetched(fetch_id))
        seconds = time.perf_counter() - started
        nbytes = num_blocks * receiver.block_bytes
        telemetry.KV_PEER_FETCHES.labels(*labels, "ok").inc()
        telemetry.KV_PEER_FETCH_BYTES.labels(*labels).inc(nbytes)
        telemetry.KV_PEER_FETCH_SECONDS.labels(*labels).inc(seconds)
        return FetchOutcome(cached, nbytes, seconds)
    except Exception as exc:  # noqa: BLE001 - every failure falls back to computing the prefix
        seconds = time.perf_counter() - started
        if pending is not None:
            _drop(async_engine, receiver, fetch_id, arrived)
        telemetry.KV_PEER_FETCHES.labels(*labels, "failed").inc()
        telemetry.KV_PEER_FETCH_SECONDS.labels(*labels).inc(seconds)
        why = _describe(exc)
        log.warning("peer fetch %s of %d blocks failed (%s); computing them", fetch_id, num_blocks, why)
        return FetchOutcome(0, 0, seconds, why)
    except asyncio.CancelledError:
        if pending is not None:
            _drop(async_engine, receiver, fetch_id, arrived)
        raise


async def _arrival(pending) -> None:
    await pending


def _drop(async_engine: AsyncEngine, receiver: Receiver, fetch_id: str, arrived: bool) -> None:
    """Free the reservation whatever its transfer's state (as the decode side drops one)."""
    if receiver.cancel(fetch_id, "peer fetch abandoned"):
        return  # open: the receiver releases the blocks once no write can reach them
    if arrived:  # the KV arrived and adopting it failed (or was cancelled): the reservation is ours
        engine = async_engine.engine
        async_engine.submit(lambda: fetch_id in engine.requests and engine.release(fetch_id))
    # else the transfer failed and the receiver released the blocks already


def _describe(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):  # a grpc.aio.AioRpcError: its status and message
        return f"{exc.code().name}: {details()}"
    return f"{type(exc).__name__}: {exc}"


async def serve_fetch(async_engine: AsyncEngine, sender: Sender, descriptor: bytes, fetch_id: str,
                      prefix: list[int], worker_id: str = "") -> PrefillResult:
    """Holder side: send the KV of ``prefix`` (whole blocks this engine holds) into the puller's
    reserved blocks. NotFoundError (after aborting the transfer, so the puller frees its blocks
    at once) when it no longer holds all of them: computing them here would cost what computing
    them there does, plus the transfer."""
    engine = async_engine.engine
    bs = engine.config.block_size
    desc = parse_descriptor(descriptor, fetch_id)
    if not prefix or len(prefix) % bs or len(prefix) // bs != desc.num_blocks:
        raise InvalidRequestError(f"a fetch is whole blocks: {len(prefix)} tokens for {desc.num_blocks} blocks "
                                  f"of {bs}", param="token_ids")
    labels = (async_engine.role, worker_id)
    held = await async_engine.call(lambda: engine.held_prefix_blocks(prefix))
    if held < desc.num_blocks:
        await asyncio.shield(sender.abort(desc, f"the holder has {held} of the {desc.num_blocks} blocks"))
        telemetry.KV_PEER_FETCH_SERVED.labels(*labels, "refused").inc()
        raise NotFoundError(f"this worker holds {held} of the prefix's {desc.num_blocks} blocks now")
    try:
        result = await prefill_and_send(async_engine, sender, desc, prefix, _PARAMS, FETCH_PRIORITY)
    except BaseException:
        telemetry.KV_PEER_FETCH_SERVED.labels(*labels, "failed").inc()
        raise
    telemetry.KV_PEER_FETCH_SERVED.labels(*labels, "ok").inc()
    return result

