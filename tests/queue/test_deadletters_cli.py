"""``pdserve deadletters`` against a real server: list, show, re-drive, and clear errors."""

import argparse
import json

import pytest

from services import deadletters_cli
from services.errors import CapacityError, InvalidRequestError
from services.queue import (
    AdmissionQueue,
    NotFoundError,
    QueueConfig,
    QueueConsumer,
    ServiceUnavailableError,
)
from services.queue.dead_letters import DeadLetters
from services.queue.keys import DEAD_STREAM, result_stream, tier_stream

from .conftest import make_request


def cli(*argv):
    parser = argparse.ArgumentParser(prog="pdserve")
    deadletters_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["deadletters", *argv])
    return args.func(args)


def kill(with_redis, *requests):
    """Queue the requests (on an emptied database) and fail each for good; returns their dead-letter ids."""

    async def go(r):
        queue, consumer = AdmissionQueue(r), QueueConsumer(r, consumer="router-x")
        for req in requests:
            await queue.enqueue(req)
        for d in await consumer.next(count=len(requests)):
            await consumer.fail(d, f"exploded on {d.request_id}", "decode-3", retryable=False)
        return [e[0].decode() for e in await r.xrange(DEAD_STREAM)]

    return with_redis(go)


def test_list_show_and_redrive(redis_url, with_redis, capsys):
    req = make_request("interactive", tokens=7, deadline=4102444800.0)
    [dead_id] = kill(with_redis, req)

    assert cli("list", "--redis-url", redis_url) == 0
    out = capsys.readouterr().out
    assert dead_id in out and req.request_id in out and "exploded on" in out and "decode-3" in out

    assert cli("list", "--redis-url", redis_url, "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["total"] == 1 and listed["dead_letters"][0]["id"] == dead_id
    assert listed["dead_letters"][0]["delivery_count"] == 1

    assert cli("show", dead_id, "--redis-url", redis_url, "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["request_id"] == req.request_id and shown["tier"] == "interactive"
    assert json.loads(shown["fields"]["token_ids"]) == req.token_ids
    assert cli("show", dead_id, "--redis-url", redis_url) == 0
    assert "prompt tokens:   7" in capsys.readouterr().out

    assert cli("redrive", dead_id, "--redis-url", redis_url) == 0
    assert f"re-drove {dead_id}" in capsys.readouterr().out

    async def after(r):
        assert await r.xlen(DEAD_STREAM) == 0
        assert not await r.exists(result_stream(req.request_id))  # the old error event is gone
        [d] = await QueueConsumer(r).next()
        return d

    d = with_redis(after, flush=False)
    assert d.request_id == req.request_id and d.delivery_count == 1 and d.tier == "interactive"
    assert d.request.token_ids == req.token_ids and d.request.deadline > req.deadline  # budget from now


def test_redrive_resets_delivery_history(redis_url, with_redis):
    cfg = QueueConfig(max_deliveries=2)
    req = make_request("batch")

    async def go(r):
        queue, consumer = AdmissionQueue(r, cfg), QueueConsumer(r, config=cfg)
        await queue.enqueue(req)
        while deliveries := await consumer.next():
            await consumer.fail(deliveries[0], "flaky", "decode-0")
        [(dead_id, _)] = await r.xrange(DEAD_STREAM)
        return dead_id.decode()

    dead_id = with_redis(go)
    assert cli("redrive", dead_id, "--redis-url", redis_url, "--json") == 0

    async def again(r):
        consumer = QueueConsumer(r, config=cfg)
        [d] = await consumer.next()
        assert d.delivery_count == 1
        assert await consumer.fail(d, "flaky", "decode-0") == "retried"  # a full set of tries again
        await consumer.ack((await consumer.next())[0])
        assert (await AdmissionQueue(r, cfg).depth()).requests == 0

    with_redis(again, flush=False)


def test_redrive_all(redis_url, with_redis, capsys):
    dead_ids = kill(with_redis, make_request("standard"), make_request("batch"), make_request("standard"))
    assert len(dead_ids) == 3
    assert cli("redrive", "--all", "--redis-url", redis_url, "--json") == 0
    redriven = json.loads(capsys.readouterr().out)["redriven"]
    assert [x["dead_id"] for x in redriven] == dead_ids

    async def check(r):
        assert await r.xlen(DEAD_STREAM) == 0
        return await r.xlen(tier_stream("standard")), await r.xlen(tier_stream("batch"))

    assert with_redis(check, flush=False) == (2, 1)
    assert cli("list", "--redis-url", redis_url) == 0
    assert "no dead letters" in capsys.readouterr().out


def test_errors_are_clear(redis_url, with_redis):
    kill(with_redis, make_request())
    with pytest.raises(NotFoundError, match="no dead letter with id '1-1'") as info:
        cli("show", "1-1", "--redis-url", redis_url)
    assert info.value.http_status == 404  # services.cli: exit 2
    with pytest.raises(NotFoundError, match="no dead letter"):
        cli("redrive", "1-1", "--redis-url", redis_url)
    with pytest.raises(InvalidRequestError, match="not a dead-letter id"):
        cli("show", "bogus", "--redis-url", redis_url)
    with pytest.raises(ServiceUnavailableError, match="cannot reach Redis at redis://127.0.0.1:1/0"):
        cli("list", "--redis-url", "redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="--limit"):
        cli("list", "--limit", "0", "--redis-url", redis_url)
    with pytest.raises(SystemExit):  # neither an id nor --all
        cli("redrive", "--redis-url", redis_url)


def test_a_redrive_refused_by_a_full_queue_keeps_the_error_event(redis_url, with_redis):
    # issue 18: the old result stream was deleted before admission, so a re-drive the queue refused
    # left the client's stream empty (its error event gone) while the request stayed a dead letter
    cfg = QueueConfig(max_queued_requests=1)
    req = make_request()
    [dead_id] = kill(with_redis, req)

    async def refused(r):
        before = await r.xrange(result_stream(req.request_id))
        await AdmissionQueue(r, cfg).enqueue(make_request())  # the queue is full now
        with pytest.raises(CapacityError, match="the queue is full"):
            await DeadLetters(r, cfg).redrive(dead_id)
        assert await r.xrange(result_stream(req.request_id)) == before  # the error event is still there
        assert [e[0].decode() for e in await r.xrange(DEAD_STREAM)] == [dead_id]
        return before

    [(_, event)] = with_redis(refused, flush=False)
    assert event[b"type"] == b"error" and b"exploded on" in event[b"data"]
