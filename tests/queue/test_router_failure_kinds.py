"""The router's queue consumer tells bad input from its own bugs: a request whose sampling parameters are wrong
is dead-lettered at once as a 400, but a TypeError raised inside the dispatch (a router bug, as the one bench
chaos found when a prefill worker died) is retried, never reported to the client as its fault."""

from __future__ import annotations

from services.queue import AdmissionQueue, QueueConsumer
from services.queue.dead_letters import DeadLetters
from services.router.queue_worker import QueueWorker
from tests.queue.conftest import make_request


class _BrokenDispatcher:
    async def generate(self, *args, **kwargs):
        raise TypeError("a coroutine was expected, got <_AioCall object>")
        yield  # an async generator, as Dispatcher.generate


async def _handle_one(r, request) -> list:
    queue = AdmissionQueue(r)
    worker = QueueWorker(r, _BrokenDispatcher())
    await worker.consumer.ensure_groups()
    await queue.enqueue(request)
    [delivery] = await worker.consumer.next()
    await worker._handle(delivery)
    return await DeadLetters(r).list()


def test_a_type_error_inside_the_dispatch_is_retried_not_dead_lettered_as_bad_input(with_redis):
    async def go(r):
        assert await _handle_one(r, make_request()) == []
        [again] = await QueueConsumer(r, consumer="other").next()  # it is back in the queue for a router
        assert again.delivery_count == 2

    with_redis(go)


def test_unknown_sampling_fields_are_still_bad_input(with_redis):
    async def go(r):
        [dead] = await _handle_one(r, make_request(sampling={"max_tokens": 8, "temprature": 0.0}))
        assert "bad sampling parameters" in dead.last_error and dead.error_code == "invalid_request_error"

    with_redis(go)
