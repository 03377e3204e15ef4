"""Result delivery: the events of every open request of this gateway, over one Redis connection.

Waiting requests cost memory, not connections. The gateway's request ids carry
its tag (``gw-<hex>``, keys.py), so every writer (decode workers, the router,
the dead-letter path) copies each event of its requests to the gateway's
delivery stream ``pd:res:{<tag>}:inbox`` in the same Lua script that appends it
to the request's own result stream (results.py). One reader task here follows
that stream with a blocking XREAD and hands each event to the subscription of
its request, an in-memory buffer; events of requests nobody here follows
(their client left) are dropped. The request's own stream stays the record:
its entry ids are the SSE ids, resumes and the router's re-drive read it.

    writers --Lua: XADD pd:res:{gw-a}:<rid> + XADD pd:res:{gw-a}:inbox--> Redis
    reader (one connection, XREAD BLOCK on the inbox) --> subscriptions[rid] --> follow()

A subscription first catches up from the request's stream (XRANGE after the
id it resumes from), holding back what the reader delivers meanwhile, then
merges the two by entry id, so no event is lost or repeated whichever came
first. The same catch-up runs again when the reader reconnects after a Redis
error (whatever was written while it was away is in the streams; a Redis that
restarted empty has neither) and when a subscription heard nothing for a while
(``quiet_check``, before each heartbeat, batched with every other subscription's).
A request another gateway queued (a client
resuming here after that gateway went away, or through another replica) is not
in this inbox: its subscription is caught up by polling its stream every
``foreign_poll_s``, all such requests in one pipelined round trip.

Nothing here holds a connection per request: the reader holds one, catch-ups
and polls borrow one from the pool for one round trip. The catch-ups of the
subscriptions opened in one turn of the loop (a burst of streams) and the
quiet checks of that turn share one pipelined round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from services import hops
from services.gateway import fanout_probe
from services.gateway.pool_wait import patiently
from services.queue.keys import delivery_tag, inbox_stream, result_stream, state_key
from services.queue.message import text
from services.queue.results import decode_event

log = logging.getLogger(__name__)

Event = tuple[str, str, Any]  # (entry id, type, data)
_TRIM_EVERY = 1024  # entries read between two trims of the inbox
_READ_GRACE_S = 60.0  # how late an XREAD BLOCK's reply may be read before the connection counts as lost


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    """One follower's events of one request, in entry-id order, each once."""

    def __init__(self, request_id: str, last_id: str):
        self.request_id = request_id
        self.last = id_key(last_id)
        self._ready: list[Event] = []
        self._held: list[Event] | None = None  # while catching up: what the reader delivered meanwhile
        self._waiter: asyncio.Future | None = None  # the follower's wait in next(), woken by the first event
        # takes an event straight from the reader while the follower is parked in next() with nothing in hand
        # (direct_write.py); returns False to leave it to the follower
        self.sink: Callable[[Event], bool] | None = None
        self.sunk = 0  # events the sink took: the follower was not quiet although next() returned nothing

    def push(self, event: Event) -> None:
        if self._held is not None:
            self._held.append(event)
        else:
            self._accept([event])

    def _accept(self, events: Iterable[Event]) -> None:
        for event in events:
            key = id_key(event[0])
            if key > self.last:
                self.last = key
                if not self._ready and self._waiter is not None and self.sink is not None and self._sink(event):
                    self.sunk += 1
                    continue
                self._ready.append(event)
        if self._ready and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _sink(self, event: Event) -> bool:
        try:
            return self.sink(event)
        except Exception:  # noqa: BLE001 - the reader serves every stream: this one falls back to its follower
            log.exception("result delivery: writing %s's chunk from the reader failed; its task writes the rest",
                          self.request_id)
            self.sink = None
            return False

    def hold(self) -> None:
        if self._held is None:
            self._held = []

    def release(self, caught_up: list[Event]) -> None:
        """End a catch-up: its events, then what the reader delivered meanwhile, in id order, once."""
        held, self._held = self._held or [], None
        self._accept(sorted([*caught_up, *held], key=lambda e: id_key(e[0])))

    @property
    def last_id(self) -> str:
        return f"{self.last[0]}-{self.last[1]}"

    async def next(self, timeout_s: float) -> list[Event]:
        """The events that arrived (waiting up to ``timeout_s`` for one); [] when none came.

        A bare future and one timer, not ``asyncio.wait_for`` on an ``Event``: on Python 3.11 wait_for
        starts a task per call, so each chunk of each open stream cost a task, its scheduling and its
        teardown on the loop every other stream's chunks wait on."""
        if not self._ready and timeout_s > 0:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _wake_up, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        events, self._ready = self._ready, []
        return events


def _inbox_entries(reply) -> list:
    """The [entry id, [field, value, ...]] pairs of an XREAD reply on one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else (entries for _, entries in reply)
    return [entry for entries in streams for entry in entries]


def _wake_up(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ResultDelivery:
    def __init__(self, redis, tag: str | None = None, block_ms: int = 1000, batch: int = 1024,
                 foreign_poll_s: float = 0.1):
        self.redis = redis
        self.tag = tag or f"gw-{uuid.uuid4().hex[:12]}"
        if delivery_tag(f"{self.tag}.x") != self.tag:
            raise ValueError(f"a delivery tag is gw- and 8-32 lowercase hex digits; got {self.tag!r}")
        self.inbox = inbox_stream(self.tag)
        self.block_ms = block_ms
        self.batch = batch
        self.foreign_poll_s = foreign_poll_s
        self._subs: dict[str, set[Subscription]] = {}
        self._foreign: set[Subscription] = set()
        self._tasks: list[asyncio.Task] = []
        self._foreign_wake = asyncio.Event()
        self._checks: list[tuple[Subscription, asyncio.Future, bool]] = []
        self._flushes: set[asyncio.Task] = set()
        self._stopping = False
        self._hop_marked: set[str] = set()  # requests whose first chunk the hop probe saw (hops.py)
        self.reader_errors = 0  # times the reader lost Redis (a test and the logs read it)

    def new_request_id(self) -> str:
        return f"{self.tag}.{uuid.uuid4().hex}"

    @property
    def open_requests(self) -> int:
        return len(self._subs)

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read(), name="result-delivery"),
                           loop.create_task(self._poll_foreign(), name="result-delivery-foreign")]
            probe = fanout_probe.start()
            if probe is not None:
                self._tasks.append(probe)

    async def close(self) -> None:
        """Stop reading. redis-py can swallow a cancellation landing while it reconnects: the flag ends the
        loops anyway, and the cancel is repeated until they are gone."""
        self._stopping = True
        self._foreign_wake.set()
        pending = set(self._tasks)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        self._tasks = []

    # -- subscriptions ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def subscribe(self, request_id: str, last_id: str = "0", until: float = 0.0):
        """A ``Subscription`` to the request's events after ``last_id``, caught up from its stream; a busy pool
        is waited out until the wall-clock ``until`` (pool_wait.py)."""
        self.start()
        sub = Subscription(request_id, last_id)
        own = delivery_tag(request_id) == self.tag
        if own:
            self._subs.setdefault(request_id, set()).add(sub)
        try:
            # registered first: whatever is written from now on reaches it one way or the other
            await patiently(lambda: self._batched(sub, status=False), until)
            if not own:
                self._foreign.add(sub)
                self._foreign_wake.set()
            yield sub
        finally:
            self._foreign.discard(sub)
            subs = self._subs.get(request_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[request_id]
                    self._hop_marked.discard(request_id)

    async def catch_up(self, subs: list[Subscription]) -> None:
        """Read each subscription's stream after its last id (one pipelined round trip for all of them)."""
        for sub in subs:
            sub.hold()
        replies: list = []
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for sub in subs:
                    pipe.xrange(result_stream(sub.request_id), f"({sub.last_id}", "+")
                replies = await pipe.execute()
        finally:
            for sub, entries in zip(subs, replies or [[]] * len(subs)):
                sub.release([(text(entry_id), *decode_event(fields)) for entry_id, fields in entries])

    async def quiet_check(self, sub: Subscription) -> tuple[bool, str | None]:
        """For a subscription that heard nothing for a while: catch it up, and say whether its result stream
        exists and the request's queue status (None: unknown). Every check asked for in the same moment
        goes in one pipelined round trip: ten thousand queued requests' heartbeats cost Redis a few
        pipelines, not thirty thousand round trips."""
        return await self._batched(sub, status=True)

    async def _batched(self, sub: Subscription, status: bool) -> tuple[bool, str | None]:
        """Catch ``sub`` up (and with ``status``, check its stream and queue status) in one pipeline with every
        other subscription asking in the same turn of the loop: new subscriptions (a burst of streams
        opening) and quiet checks alike. Without ``status`` the answer is (True, None)."""
        sub.hold()  # registered first: what the reader delivers meanwhile is held, then merged
        future = asyncio.get_running_loop().create_future()
        self._checks.append((sub, future, status))
        if len(self._checks) == 1:  # the first of a batch flushes it, on the loop's next turn
            task = asyncio.get_running_loop().create_task(self._flush_checks())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
        return await future

    async def _flush_checks(self) -> None:
        batch, self._checks = self._checks, []
        replies: list = []
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for sub, _, status in batch:
                    key = result_stream(sub.request_id)
                    pipe.xrange(key, f"({sub.last_id}", "+")
                    if status:
                        pipe.exists(key)
                        pipe.hget(state_key(sub.request_id), "status")
                replies = await pipe.execute()
        except BaseException as exc:  # each follower decides what Redis trouble means for its client
            for sub, future, _ in batch:
                sub.release([])
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:  # the flush was cancelled (the gateway stops): its askers are too, not left waiting
                    future.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        at = 0
        for sub, future, status in batch:
            entries = replies[at]
            sub.release([(text(entry_id), *decode_event(fields)) for entry_id, fields in entries])
            answer = (True, None)
            if status:
                exists, state = replies[at + 1:at + 3]
                answer = (bool(exists), None if state is None else text(state))
            at += 3 if status else 1
            if not future.done():
                future.set_result(answer)

    # -- the reader ---------------------------------------------------------------------------

    async def _read(self) -> None:
        # one of the pool's connections, held for good: taking one from the pool for each XREAD queued the
        # reader, and so every open stream's next chunks, behind whatever else the gateway was sending (a
        # wave of new requests' admissions, catch-ups) first come, first served (fair_pool.py)
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        try:
            await self._follow_inbox(conn)
        finally:
            async def give_back() -> None:  # an XREAD may still be in flight on it: never back to the pool as is
                await conn.disconnect()
                await pool.release(conn)

            with contextlib.suppress(Exception):
                await asyncio.shield(give_back())

    async def _follow_inbox(self, conn) -> None:
        """XREAD BLOCK on the inbox, always one read ahead: the next XREAD goes out as soon as a reply is in
        (its last id is known then), before that reply's events are handed on. Redis answers or blocks it
        while the chunks of this one are written (direct_write.py), so what arrives meanwhile is already on
        the socket when the reader comes back, not one round trip and one Redis wake-up later."""
        # from the start, not "$": the tag is this process's, so everything in its inbox is for it, and a
        # subscription made before this first read (it caught up already) must still get what follows
        last, unread_since_trim, failing, in_flight = "0-0", 0, False, False
        xread = ("XREAD", "COUNT", self.batch, "BLOCK", self.block_ms, "STREAMS", self.inbox)
        while not self._stopping:
            try:
                if not in_flight:
                    await conn.send_command(*xread, last, check_health=False)
                # a blocking read: its reply can be late only because this loop is (a burst of thousands being
                # admitted), which is not an outage; redis-py's 5 s socket timeout would make it one
                entries = _inbox_entries(await conn.read_response(timeout=self.block_ms / 1e3 + _READ_GRACE_S))
                if entries:
                    last = text(entries[-1][0])
                in_flight = False
                await conn.send_command(*xread, last, check_health=False)
                in_flight = True
                if failing:  # back after an outage: whatever was written meanwhile is in the result streams
                    failing = False
                    log.info("result delivery: reading %s again", self.inbox)
                    await self.catch_up([s for subs in self._subs.values() for s in subs])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away or restarting: one line, not one per request
                self.reader_errors += 1
                in_flight = False
                with contextlib.suppress(Exception):
                    await conn.disconnect()  # a half-read reply must not be taken for the next one
                if not failing:
                    log.warning("result delivery: reading %s failed (%s: %s); retrying", self.inbox,
                                type(exc).__name__, exc)
                failing = True
                await asyncio.sleep(0.5)
                continue
            read_at = time.time() if fanout_probe.enabled() else 0.0
            for position, (_, fields) in enumerate(entries):
                self._dispatch(fields, read_at, len(entries), position)
            unread_since_trim += len(entries)
            if unread_since_trim >= _TRIM_EVERY:  # on a pooled connection: this one has an XREAD in flight
                unread_since_trim = 0
                task = asyncio.get_running_loop().create_task(self._trim(last))
                self._flushes.add(task)
                task.add_done_callback(self._flushes.discard)

    async def _trim(self, upto: str) -> None:
        with contextlib.suppress(Exception):  # the cap bounds it anyway
            await self.redis.xtrim(self.inbox, minid=upto, approximate=True)

    def _dispatch(self, fields: list, read_at: float = 0.0, batch: int = 0, position: int = 0) -> None:
        it = iter(fields)  # the entry's flat field-value list, as XREAD returns it
        f = {text(k): v for k, v in zip(it, it)}
        event_rid = text(f.get("rid", b""))
        subs = self._subs.get(event_rid)
        if not subs:
            return  # nobody here follows it (its client left): the result stream keeps it
        try:
            event = (text(f["id"]), *decode_event(f))
        except (KeyError, ValueError) as exc:
            log.warning("result delivery: skipping a malformed inbox entry: %s", exc)
            return
        if read_at and event[1] == "chunk":
            fanout_probe.read(event_rid, event[0], read_at, batch, position)
        if event[1] == "chunk" and hops.enabled() and event_rid not in self._hop_marked:
            self._hop_marked.add(event_rid)
            hops.mark(event_rid, "gw.delivered")
        for sub in subs:
            sub.push(event)

    async def _poll_foreign(self) -> None:
        while not self._stopping:
            if not self._foreign:
                self._foreign_wake.clear()
                await self._foreign_wake.wait()
                continue
            await asyncio.sleep(self.foreign_poll_s)
            try:
                await self.catch_up(list(self._foreign))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # their followers time out if this lasts
                log.debug("result delivery: polling foreign streams failed: %s", exc)
