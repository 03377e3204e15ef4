"""A request whose client left while it queued (the cancel flag is set) ends with a final "abort" and its
dispatch is cancelled, though the router reads the flag beside the dispatch rather than before it; a
request without the flag runs to its finish."""

from __future__ import annotations

import asyncio

from proto.pdserve.v1 import common_pb2
from services.queue import AdmissionQueue
from services.queue.cancel import cancel_key
from services.queue.keys import result_stream, tier_stream
from services.queue.results import decode_event
from services.router.queue_worker import QueueWorker
from tests.queue.conftest import make_request


class _Dispatcher:
    """Holds each dispatch until ``release`` is set (a worker still computing), then finishes it."""

    def __init__(self):
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def generate(self, request_id, *args, **kwargs):
        self.started.append(request_id)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)  # the worker calls would be cancelled here, freeing blocks
            raise
        yield common_pb2.Finish(finish_reason="stop")


async def _run(r, flagged: bool) -> tuple[_Dispatcher, list[tuple[str, dict]], int]:
    dispatcher = _Dispatcher()
    worker = QueueWorker(r, dispatcher)
    await worker.consumer.ensure_groups()
    request = make_request()
    await AdmissionQueue(r).enqueue(request)
    if flagged:
        await r.set(cancel_key(request.request_id), 1)
    [delivery] = await worker.consumer.next()
    handle = asyncio.create_task(worker._handle(delivery))
    if not flagged:
        while not dispatcher.started:
            await asyncio.sleep(0.01)
        dispatcher.release.set()
    ended, _ = await asyncio.wait([handle], timeout=10)  # a dispatch nobody cancels would hold it forever
    assert ended, "the request was still dispatched 10 s later"
    events = [decode_event(fields) for _, fields in await r.xrange(result_stream(request.request_id))]
    pending = (await r.xpending(tier_stream(delivery.tier), worker.consumer.group))["pending"]
    return dispatcher, events, pending


def test_a_request_cancelled_while_queued_ends_aborted_and_its_dispatch_is_cancelled(with_redis):
    async def go(r):
        dispatcher, events, pending = await _run(r, flagged=True)
        assert events[-1][0] == "final" and events[-1][1]["finish_reason"] == "abort"
        assert dispatcher.cancelled == dispatcher.started  # a dispatch that began was cancelled, not left running
        assert pending == 0  # acked: no router picks it up again

    with_redis(go)


def test_a_request_without_the_flag_runs_to_its_finish(with_redis):
    async def go(r):
        dispatcher, events, pending = await _run(r, flagged=False)
        assert events[-1][0] == "final" and events[-1][1]["finish_reason"] == "stop"
        assert dispatcher.cancelled == [] and pending == 0

    with_redis(go)
