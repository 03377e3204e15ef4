"""What a profiler shows of an engine thread: the torch profiler's step ranges name their requests' trace
ids, and on CUDA the NVTX ranges (Nsight Systems) carry the phase names and balance.

There is no GPU here, so the NVTX test replaces ``torch.cuda.nvtx`` with a recorder and says CUDA is
initialised (the only fake: without it the NVTX path never runs on this machine). It checks what a GPU
run's Nsight view depends on: every push is popped on the same thread, in nesting order, and the
ranges are the phases'.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from services.engine.async_engine import AsyncEngine
from services.engine.sampling_params import SamplingParams
from services.profiling import request_traces

TRACE_A = 0x4BF92F3577B34DA6A3CE929D0E0E4736
TRACE_B = 0x0AF7651916CD43DD8448EB211C80319C


def _run(engine, prompts: dict[str, list[int]], tokens: int = 4) -> None:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()


def test_profiled_steps_name_the_trace_ids_of_their_requests(tiny_engine, tmp_path):
    engine = tiny_engine()
    prompts = {"req-a": list(range(20, 60)), "req-b": list(range(100, 140)), "req-c": list(range(200, 230))}
    with request_traces.bound("req-a", TRACE_A), request_traces.bound("req-b", TRACE_B):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _run(engine, prompts)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    names = [e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
             if e.get("cat") == "user_annotation"]
    a, b = f"trace_id={TRACE_A:032x}", f"trace_id={TRACE_B:032x}"
    # the prompts' forward, and decode steps batching both requests, each findable by either trace id
    assert any(n.startswith("requests forward_prefill:") and a in n for n in names), names
    decode = [n for n in names if n.startswith("requests forward_decode:")]
    assert any(a in n and b in n for n in decode), decode
    # a request with no trace context is listed by its id; ids are unbound after their block
    assert any("request_id=req-c" in n for n in decode), decode
    assert request_traces.trace_id("req-a") is None


def test_no_request_range_while_the_profiler_is_off(tiny_engine, monkeypatch):
    built = []
    monkeypatch.setattr(request_traces, "range_name", lambda *a: built.append(a) or "x")
    _run(tiny_engine(), {"req-a": list(range(20, 40))})
    assert built == []


class NvtxRecorder:
    """Stands in for ``torch.cuda.nvtx``: the push/pop calls, by thread."""

    def __init__(self):
        self.calls: list[tuple[int, str, str | None]] = []
        self.lock = threading.Lock()

    def range_push(self, name: str) -> int:
        with self.lock:
            self.calls.append((threading.get_ident(), "push", name))
        return 0

    def range_pop(self) -> int:
        with self.lock:
            self.calls.append((threading.get_ident(), "pop", None))
        return 0


def test_nvtx_ranges_balance_and_carry_the_phase_names(tiny_engine, monkeypatch):
    recorder = NvtxRecorder()
    monkeypatch.setattr(torch.cuda, "nvtx", recorder)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    async_engine = AsyncEngine(tiny_engine(), role="decode")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def run():
        async def one(rid, prompt):
            return [o async for o in async_engine.generate(prompt, params, request_id=rid)]
        first = asyncio.ensure_future(one("n1", list(range(20, 60))))
        await asyncio.sleep(0.05)
        return await one("n2", list(range(100, 140))), await first

    try:
        outs = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        async_engine.shutdown()
    assert all(sum(len(o.new_token_ids) for o in out) == 5 for out in outs)

    stacks: dict[int, list[str]] = {}
    pushed = set()
    for thread, op, name in recorder.calls:
        stack = stacks.setdefault(thread, [])
        if op == "push":
            stack.append(name)
            pushed.add(name)
        else:
            assert stack, "an NVTX pop without a push on its thread"
            stack.pop()
    # the engine thread may sit in an idle range at shutdown; every other range ended where it began
    assert all(s in ([], ["idle"]) for s in stacks.values()), stacks
    for name in ("engine.step", "schedule", "forward_prefill", "forward_decode", "sample", "postprocess",
                 "publish", "commands", "idle"):
        assert name in pushed, (name, sorted(pushed))
    # phases nest inside a step: a forward range is pushed while engine.step is open
    depth_ok = False
    open_ranges: list[str] = []
    for _, op, name in recorder.calls:
        if op == "push":
            depth_ok |= name == "forward_decode" and "engine.step" in open_ranges
            open_ranges.append(name)
        elif open_ranges:
            open_ranges.pop()
    assert depth_ok


class PassThroughNvtx(NvtxRecorder):
    """The recorder above, calling the real NVTX functions too (on a GPU: what Nsight Systems would see)."""

    def __init__(self, real):
        super().__init__()
        self.real = real

    def range_push(self, name: str) -> int:
        super().range_push(name)
        return self.real.range_push(name)

    def range_pop(self) -> int:
        super().range_pop()
        return self.real.range_pop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA engine needs a GPU")
def test_on_cuda_nvtx_ranges_balance_and_profiled_steps_name_their_trace_ids(monkeypatch, tmp_path):
    from services.config import EngineConfig
    from services.engine.engine import Engine

    engine = Engine(EngineConfig(model="dummy:tiny", dtype="bf16", device="cuda", kv_cache_bytes=64 << 20,
                                 max_model_len=1024))
    recorder = PassThroughNvtx(torch.cuda.nvtx)
    monkeypatch.setattr(torch.cuda, "nvtx", recorder)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with request_traces.bound("req-a", TRACE_A), request_traces.bound("req-b", TRACE_B):
        with torch.profiler.profile(activities=activities) as prof:
            _run(engine, {"req-a": list(range(20, 60)), "req-b": list(range(100, 140))}, tokens=6)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    a, b = f"trace_id={TRACE_A:032x}", f"trace_id={TRACE_B:032x}"
    assert any(n.startswith("requests forward_decode:") and a in n and b in n for n in names), names
    assert any(e.get("cat") == "kernel" for e in events)  # the GPU's kernels are in the same trace
    depth = 0
    pushed = set()
    for _, op, name in recorder.calls:
        depth += 1 if op == "push" else -1
        assert depth >= 0
        pushed.add(name)
    assert depth == 0
    assert {"schedule", "forward_prefill", "forward_decode", "sample", "postprocess"} <= pushed, pushed
    assert any(n and n.startswith("requests forward_decode:") for n in pushed)
