"""The views admission reads (worker list, queue depth): shared by a burst, refreshed in the background."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.cached_read import CachedRead


class Source:
    """A value that changes on every read; remembers which reads came from the background task."""

    def __init__(self):
        self.reads = 0
        self.by_requests = 0
        self.background: asyncio.Task | None = None
        self.fail = False

    async def read(self) -> int:
        await asyncio.sleep(0.001)  # a round trip
        if asyncio.current_task() is not self.background:
            self.by_requests += 1
        if self.fail:
            raise ConnectionError("redis is away")
        self.reads += 1
        return self.reads


async def _until(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_a_burst_of_requests_shares_one_read():
    async def go():
        src = Source()
        view = CachedRead(src.read, max_age_s=30.0)
        values = await asyncio.gather(*(view.get() for _ in range(20)))
        assert values == [1] * 20 and src.reads == 1

    asyncio.run(go())


def test_without_caching_every_request_reads():
    async def go():
        src = Source()
        view = CachedRead(src.read, max_age_s=0.0)
        assert [await view.get() for _ in range(3)] == [1, 2, 3]
        await asyncio.wait_for(view.keep_fresh(), 1.0)  # nothing to keep fresh: returns at once

    asyncio.run(go())


def test_background_refresh_keeps_the_view_current_without_requests_reading():
    async def go():
        src = Source()
        view = CachedRead(src.read, max_age_s=0.05)
        src.background = asyncio.create_task(view.keep_fresh())
        try:
            await _until(lambda: src.reads >= 1)
            seen = [await view.get()]
            await _until(lambda: src.reads >= 4)  # the value moved on with nobody asking
            seen.append(await view.get())
            assert seen[1] > seen[0]
            assert src.by_requests == 0  # no request waited for a read
        finally:
            src.background.cancel()
            await asyncio.gather(src.background, return_exceptions=True)

    asyncio.run(go())


def test_a_failing_background_read_is_never_hidden_behind_a_stale_value():
    async def go():
        src = Source()
        view = CachedRead(src.read, max_age_s=0.05)
        src.background = asyncio.create_task(view.keep_fresh())
        try:
            await _until(lambda: src.reads >= 1)
            src.fail = True  # Redis goes away: the background read fails from now on
            await asyncio.sleep(0.1)  # the last good value is now too old to admit on
            with pytest.raises(ConnectionError):
                await view.get()  # the request reads for itself and sees the failure
            src.fail = False
            assert await view.get() > 1  # and recovers with Redis
        finally:
            src.background.cancel()
            await asyncio.gather(src.background, return_exceptions=True)

    asyncio.run(go())


def test_a_stale_hint_is_answered_at_once_and_read_again_only_when_asked():
    """serve_stale (the queue depth): a request never waits for a read once there is a value, and nothing
    reads while nobody asks (an idle gateway read the depth every 80 ms)."""
    async def go():
        src = Source()
        view = CachedRead(src.read, max_age_s=0.01, serve_stale=True)
        assert await view.get() == 1  # no value yet: this one reads
        await asyncio.sleep(0.1)  # idle: ten times max_age_s
        assert src.reads == 1
        assert await view.get() == 1  # stale, answered at once; a read starts in the background
        await _until(lambda: src.reads == 2)
        await asyncio.sleep(0.05)
        assert await view.get() == 2 and src.reads == 2  # one read per stale get, not a loop
        await _until(lambda: src.reads == 3)
        src.fail = True  # Redis goes away
        await asyncio.sleep(0.05)
        assert await view.get() == 3  # answered from before; its background read fails
        await _until(lambda: view._revalidating is None)
        with pytest.raises(ConnectionError):
            await view.get()  # the failure is not hidden: the next request reads for itself

    asyncio.run(go())
