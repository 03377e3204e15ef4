"""Profiling on demand without a model: the Admin gRPC call, the span recorder, the merge, the CLI.

The Admin service runs on a real grpc.aio server on loopback (in a background loop);
Redis is the real test server. The whole stack's profile is tests/services/test_profile_stack.py.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time

import grpc
import pytest
from opentelemetry import trace

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc
from services import cli, telemetry
from services.profiling import merge
from services.profiling.admin import AdminServicer, Profiler
from services.profiling.peers import Peer
from services.profiling.recording import record_spans
from services.profiling.spans import SpanRecorder


class AdminServer:
    """One Admin server in its own event loop thread; ``profiler`` is served as given."""

    def __init__(self, profiler: Profiler):
        self.profiler = profiler
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.profiler), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def admin():
    servers = []

    def start(enabled: bool = True, record=record_spans, role: str = "router", peers=None) -> AdminServer:
        servers.append(AdminServer(Profiler(role, f"{role}-test", enabled, record, peers)))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


async def _call(port: int, **request) -> admin_pb2.ProfileResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return await admin_pb2_grpc.AdminStub(ch).Profile(admin_pb2.ProfileRequest(**request), timeout=30)


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf"), 301.0])
def test_bad_seconds_are_invalid_argument(admin, seconds):
    server = admin()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_call(server.port, seconds=seconds))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "seconds must be in (0, 300]" in err.value.details()


def test_disabled_process_answers_failed_precondition_naming_the_flag(admin):
    server = admin(enabled=False)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_call(server.port, seconds=1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-profiling" in err.value.details()


def test_a_second_recording_while_one_runs_is_aborted(admin):
    server = admin()

    async def both():
        first = asyncio.create_task(_call(server.port, seconds=1.5))
        await asyncio.sleep(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _call(server.port, seconds=1)
        assert err.value.code() == grpc.StatusCode.ABORTED
        return await first

    reply = asyncio.run(both())
    assert reply.traces[0].role == "router"  # the first one still finished


def test_spans_of_a_request_carry_its_trace_id_and_only_while_recording(with_redis):
    telemetry.setup_tracing("pdserve-test")
    tracer = telemetry.tracer("test")

    async def go(redis):
        recorder = SpanRecorder()
        recorder.start()
        with tracer.start_as_current_span("route", attributes={"request_id": "r1"}) as span:
            trace_id = f"{span.get_span_context().trace_id:032x}"
            await asyncio.create_task(asyncio.sleep(0.01), name="child")
            await redis.set("profiling-test", "1")
        with tracer.start_as_current_span("metrics scrape"):
            pass
        running = tracer.start_span("decode", attributes={"request_id": "r3"})
        recorder.stop()
        running.end()
        with tracer.start_as_current_span("after", attributes={"request_id": "r2"}):
            await redis.get("profiling-test")
        return recorder, trace_id

    recorder, trace_id = with_redis(go)
    begins = [e for e in recorder.events if e["ph"] == "b"]
    spans = {e["name"]: e for e in begins if e["cat"] == "span"}
    assert spans["route"]["args"]["trace_id"] == trace_id
    assert spans["route"]["args"]["request_id"] == "r1"
    assert "after" not in spans  # started after stop
    assert spans["decode"]["args"]["open_at_stop"] is True  # still running at stop: cut there, not lost
    assert recorder.requests == 2  # the span without a request id is not activity
    assert any(e["cat"] == "asyncio" and e["name"] == "task child" for e in begins)
    assert any(e["cat"] == "redis" and e["name"] == "redis SET" for e in begins)
    assert not any(e["name"] == "redis GET" for e in begins)  # the Redis hook is gone after stop
    assert len(recorder.events) == 2 * len(begins)  # every range closed


def _trace(role: str, pid_name: str, events: list[dict], offset_ns: int = 0, rtt_ns: int = 0, activity: int = 1):
    return admin_pb2.ProcessTrace(role=role, process_id=pid_name, activity=activity, clock_offset_ns=offset_ns,
                                  clock_rtt_ns=rtt_ns,
                                  trace_gzip=gzip.compress(json.dumps({"traceEvents": events}).encode()))


def test_merge_aligns_clocks_by_the_measured_offsets():
    # The same instant, 1_000_000.0 us on the router's clock, is 1_002_500.0 us on the worker's
    # (its clock runs 2.5 ms ahead): aligned, both events sit at the same point of the timeline.
    router = _trace("router", "router-1", [{"ph": "X", "name": "route", "ts": 1_000_000.0, "dur": 10, "pid": 7,
                                             "tid": 1}])
    worker = _trace("decode", "decode-1", [{"ph": "X", "name": "engine.step", "ts": 1_002_500.0, "dur": 5,
                                             "pid": 7, "tid": 2},
                                            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "x"}}],
                    offset_ns=2_500_000, rtt_ns=400_000)
    merged, per_process = merge.align([router, worker])
    events = {e["name"]: e for e in merged["traceEvents"] if e["ph"] == "X"}
    assert events["route"]["ts"] == events["engine.step"]["ts"] == 0.0
    assert events["route"]["pid"] != events["engine.step"]["pid"]  # one process each, though the OS pids clash
    names = sorted(e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name")
    assert names == ["decode decode-1", "router router-1"]  # torch's own process name replaced
    assert merged["otherData"]["pdserve_origin_unix_us"] == 1_000_000.0
    clock = [c for c in merged["otherData"]["pdserve_clocks"] if c["process"] == "decode decode-1"][0]
    assert clock["uncertainty_ns"] == 200_000
    assert sorted(per_process) == ["decode-decode-1.json", "router-router-1.json"]
    json.loads(json.dumps(merged))  # plain JSON, as Perfetto reads it


async def serving(seconds: float, with_stack: bool):
    """A process's recording while it serves one request for the whole window."""
    recorder = SpanRecorder()
    recorder.start()
    with trace.get_tracer("test").start_as_current_span("route", attributes={"request_id": "r"}):
        await asyncio.sleep(seconds)
    recorder.stop()
    return recorder.events, recorder.requests


def _cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["profile", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_bad_seconds_is_a_usage_error(capsys):
    code, out = _cli(capsys, "--seconds", "0", "--address", "127.0.0.1:1")
    assert code == 2 and "seconds must be in (0, 300]" in out


def test_cli_without_a_router_says_so(capsys, tmp_path):
    code, out = _cli(capsys, "--seconds", "1", "--address", "127.0.0.1:1", "--out", str(tmp_path / "p"))
    assert code == 1 and "cannot reach a router at 127.0.0.1:1" in out
    assert not (tmp_path / "p").exists()


def test_cli_against_a_disabled_stack_says_how_to_enable_it(admin, capsys, tmp_path):
    server = admin(enabled=False)
    code, out = _cli(capsys, "--seconds", "1", "--address", f"127.0.0.1:{server.port}", "--out", str(tmp_path / "p"))
    assert code == 1 and "profiling is disabled" in out and "--enable-profiling" in out
    assert not (tmp_path / "p").exists()


def test_cli_on_an_idle_stack_writes_nothing(admin, capsys, tmp_path):
    server = admin()
    code, out = _cli(capsys, "--seconds", "0.5", "--address", f"127.0.0.1:{server.port}", "--out", str(tmp_path / "p"))
    assert code == 1 and "nothing to record" in out and "idle" in out
    assert not (tmp_path / "p").exists()


def test_cli_writes_the_processes_traces_and_the_merge(admin, capsys, tmp_path):
    telemetry.setup_tracing("pdserve-test")
    server = admin(record=serving)
    out_dir = tmp_path / "p"
    code, out = _cli(capsys, "--seconds", "0.3", "--address", f"127.0.0.1:{server.port}", "--out", str(out_dir))
    assert code == 0, out
    assert sorted(p.name for p in out_dir.iterdir()) == ["merged.json", "router-router-test.json"]
    merged = json.loads((out_dir / "merged.json").read_text())
    assert any(e.get("name") == "route" for e in merged["traceEvents"])


def test_fan_out_names_the_peer_that_could_not_be_profiled(admin, capsys, tmp_path):
    telemetry.setup_tracing("pdserve-test")
    worker = admin(record=serving, role="decode")
    disabled = admin(enabled=False, role="prefill")

    async def peers():
        return [Peer("decode", "decode-test", f"127.0.0.1:{worker.port}"),
                Peer("prefill", "prefill-test", f"127.0.0.1:{disabled.port}"),
                Peer("gateway", "gateway-gone", "127.0.0.1:1")]

    router = admin(peers=peers)
    out_dir = tmp_path / "p"
    code, out = _cli(capsys, "--seconds", "0.5", "--address", f"127.0.0.1:{router.port}", "--out", str(out_dir))
    assert code == 1  # what was recorded is written, and the command says it is partial
    assert "prefill prefill-test: not profiled: FAILED_PRECONDITION" in out and "--enable-profiling" in out
    assert "gateway gateway-gone: not profiled: UNAVAILABLE" in out
    assert "2 of 4 processes were not profiled" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["decode-decode-test.json", "merged.json",
                                                         "router-router-test.json"]
    clocks = json.loads((out_dir / "merged.json").read_text())["otherData"]["pdserve_clocks"]
    decode = [c for c in clocks if c["process"] == "decode decode-test"][0]
    assert abs(decode["clock_offset_ns"]) <= decode["uncertainty_ns"] + 5_000_000  # one host: offset ~ noise
