"""What the stack tests share: the single-engine reference, and the workers' leak check.

``reference(prompt, max_tokens, **sampling)``: greedy token ids of one in-process engine on
the default model (fp32), a prompt of text or token ids; what a stack must reproduce.

The leak check: after every passing test of a module with a ``stack`` fixture, each worker
process still running has all its KV blocks free once idle (GetLoad, 30 s at most). Engines
inside the test process (the reference's too) are checked by tests/conftest.py.
"""

from __future__ import annotations

import pytest

from tests.services.stack import live_workers, wait_idle


@pytest.fixture(scope="session")
def reference_engine():
    from services.config import EngineConfig
    from services.engine.engine import Engine

    return Engine(EngineConfig(dtype="float32"))


@pytest.fixture(scope="session")
def reference(reference_engine):
    from services.engine.sampling_params import SamplingParams
    from tests.engine.checks import generate_alone

    def run(prompt: str | list[int], max_tokens: int, **sampling) -> list[int]:
        ids = reference_engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, **sampling)
        return generate_alone(reference_engine, {"reference": ids}, params)["reference"]

    run.tokenizer = reference_engine.tokenizer
    return run


@pytest.fixture(autouse=True)
def workers_leak_check(request):
    stack = request.getfixturevalue("stack") if "stack" in request.fixturenames else None
    yield
    if stack is None or getattr(request.node, "call_failed", True):
        return
    workers = live_workers(stack.procs)
    assert wait_idle(workers) == {n: 0 for n in workers}
