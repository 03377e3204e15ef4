"""Result streams: many requests' chunks per round trip, ordered, resumable, expiring."""

import asyncio

import pytest

from services.errors import DeadlineExceededError, InvalidRequestError
from services.queue import NotFoundError, ResultReader, ResultWriter
from services.queue.keys import result_stream


class RoundTrips:
    """Counts what a client sends: each pipeline execute and each direct command is one round trip."""

    def __init__(self, client):
        self.count = 0
        direct, make_pipeline = client.execute_command, client.pipeline

        async def execute_command(*args, **kw):
            self.count += 1
            return await direct(*args, **kw)

        def pipeline(*args, **kw):
            pipe = make_pipeline(*args, **kw)
            execute = pipe.execute

            async def counted(*a, **k):
                self.count += 1
                return await execute(*a, **k)

            pipe.execute = counted
            return pipe

        client.execute_command, client.pipeline = execute_command, pipeline


async def collect(reader, request_id, **kw):
    return [event async for event in reader.read(request_id, **kw)]


def test_one_round_trip_per_step_for_many_requests(with_redis):
    async def go(r):
        writer = ResultWriter(r, ttl_s=120)
        trips = RoundTrips(r)
        for step in range(3):
            ids = await writer.append_chunks([(f"r{n}", {"token_ids": [step * 10 + n], "text": f"<{n}.{step}>"})
                                              for n in range(3)])
            assert len(ids) == 3
        assert trips.count == 3  # one per engine step, whatever the number of requests
        for n in range(3):
            await writer.finish(f"r{n}", {"finish_reason": "length", "usage": {"completion_tokens": 3}})
        reader = ResultReader(r)
        for n in range(3):
            events = await collect(reader, f"r{n}")
            assert [data["text"] for kind, data in [e[1:] for e in events[:-1]]] == [f"<{n}.{s}>" for s in range(3)]
            assert events[-1][1:] == ("final", {"finish_reason": "length", "usage": {"completion_tokens": 3}})
            assert 0 < await r.ttl(result_stream(f"r{n}")) <= 120

    with_redis(go)


def test_every_write_refreshes_the_ttl(with_redis):
    async def go(r):
        writer = ResultWriter(r, ttl_s=300)
        await writer.append_chunks([("x", {"text": "a"})])
        await r.expire(result_stream("x"), 5)
        await writer.append_chunks([("x", {"text": "b"})])
        assert await r.ttl(result_stream("x")) > 5
        await r.expire(result_stream("x"), 5)
        await writer.error("x", "kv_transfer_error", "peer gone")
        assert await r.ttl(result_stream("x")) > 5

    with_redis(go)


def test_resume_from_any_entry_has_no_duplicates_or_gaps(with_redis):
    async def go(r):
        writer, reader = ResultWriter(r), ResultReader(r)
        for i in range(6):
            await writer.append_chunks([("req", {"text": str(i)})])
        await writer.finish("req", {"finish_reason": "stop"})
        full = await collect(reader, "req")
        assert [e[1] for e in full] == ["chunk"] * 6 + ["final"]
        for cut in (0, 2, 5, 6):
            rest = await collect(reader, "req", last_id=full[cut][0])
            assert rest == full[cut + 1:]
            assert "".join(d["text"] for _, k, d in full[:cut + 1] + rest if k == "chunk") == "012345"

    with_redis(go)


def test_reader_follows_a_live_stream(with_redis):
    async def go(r):
        writer, reader = ResultWriter(r), ResultReader(r)

        async def decode():
            for i in range(4):
                await asyncio.sleep(0.02)
                await writer.append_chunks([("live", {"text": str(i)})])
            await writer.error("live", "kv_transfer_error", "decode worker died", 502)

        task = asyncio.create_task(decode())
        events = await collect(reader, "live", block_ms=50, timeout_s=5)
        await task
        assert [(k, d.get("text")) for _, k, d in events[:4]] == [("chunk", str(i)) for i in range(4)]
        assert events[-1][1:] == ("error", {"code": "kv_transfer_error", "message": "decode worker died", "status": 502})

    with_redis(go)


def test_missing_or_stalled_streams_give_clear_errors(with_redis):
    async def go(r):
        reader = ResultReader(r)
        with pytest.raises(NotFoundError, match="no result stream for request 'ghost'"):
            await collect(reader, "ghost", block_ms=50, timeout_s=0.2)
        await ResultWriter(r).append_chunks([("stalled", {"text": "a"})])
        with pytest.raises(DeadlineExceededError, match="no result event"):
            await collect(reader, "stalled", block_ms=50, timeout_s=0.2)
        with pytest.raises(InvalidRequestError, match="not a result event id"):
            await collect(reader, "stalled", last_id="abc")

    with_redis(go)


def test_a_gateway_tagged_request_has_its_events_copied_to_that_gateways_delivery_stream(with_redis):
    # one slot per gateway: the request's stream and the gateway's inbox are written in one script
    from services.queue.keys import delivery_tag, inbox_stream
    from services.queue.message import text

    async def go(r):
        writer = ResultWriter(r, ttl_s=120)
        ours, theirs, plain = "gw-0a1b2c3d.r1", "gw-99999999.r2", "r3"
        assert delivery_tag(ours) == "gw-0a1b2c3d" and delivery_tag(plain) is None
        assert result_stream(ours) == "pd:res:{gw-0a1b2c3d}:gw-0a1b2c3d.r1"
        trips = RoundTrips(r)
        ids = await writer.append_chunks([(ours, {"token_ids": [1], "text": "a"}),
                                          (theirs, {"token_ids": [2], "text": "b"}),
                                          (plain, {"token_ids": [3], "text": "c"})])
        assert trips.count == 1  # still one round trip per engine step
        final_id = await writer.finish(ours, {"finish_reason": "stop"})
        inbox = await r.xrange(inbox_stream("gw-0a1b2c3d"))
        assert [(f[b"rid"].decode(), f[b"id"].decode(), f[b"type"].decode()) for _, f in inbox] == \
            [(ours, ids[0], "chunk"), (ours, final_id, "final")]
        assert [e[0] for e in await collect(ResultReader(r), ours)] == [ids[0], final_id]
        assert len(await r.xrange(inbox_stream("gw-99999999"))) == 1
        assert [text(e[0]) for e in await r.xrange(result_stream(plain))] == [ids[2]]  # no inbox for it
        assert 0 < await r.ttl(inbox_stream("gw-0a1b2c3d")) <= 120

    with_redis(go)


@pytest.mark.parametrize("request_id", ["plain-req", "gw-0123456789abcdef.req"])
def test_a_failed_attempts_late_chunk_is_dropped_once_the_retry_is_fenced_in(with_redis, request_id):
    """The race of a prefill worker killed mid-request: the first attempt's decode worker still has a
    chunk on its way when the router retries; the retry resumes from what the stream held, so that
    late chunk must never reach the client (it would be a duplicate token)."""
    async def go(r):
        writer = ResultWriter(r, ttl_s=120)
        ids = await writer.append_chunks([(request_id, {"token_ids": [1]})], attempts=[f"{request_id}.1"])
        assert ids[0] is not None  # no fence yet: the first attempt writes freely
        await writer.fence(request_id, f"{request_id}.2")
        late = await writer.append_chunks([(request_id, {"token_ids": [2]}), (request_id, {"token_ids": [7]})],
                                          attempts=[f"{request_id}.1", f"{request_id}.2"])
        assert late[0] is None and late[1] is not None
        await writer.finish(request_id, {"finish_reason": "length"})
        events = await collect(ResultReader(r), request_id)
        assert [data["token_ids"] for _, kind, data in events if kind == "chunk"] == [[1], [7]]
        if request_id.startswith("gw-"):  # the gateway's delivery stream got the same, no more
            inbox = await r.xrange("pd:res:{gw-0123456789abcdef}:inbox")
            assert [f[b"type"] for _, f in inbox] == [b"chunk", b"chunk", b"final"]

    with_redis(go)
