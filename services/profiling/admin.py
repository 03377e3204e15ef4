"""The Admin gRPC service (proto/pdserve/v1/admin.proto) every pdserve process serves.

``Profile`` records this process for the asked seconds through its ``record``
function (torch profiler + spans in workers, spans in router and gateway) and,
with ``fan_out``, every peer at the same time::

    caller --Profile(fan_out)--> router: records itself
                                  +--Clock x3, Profile--> each worker, gateway (concurrently)
                                  <-- one ProcessTrace per process, clock offsets vs the router

A peer that is disabled, busy or unreachable comes back as a ProcessTrace with
``error`` set, so the caller can say which one and why, never an empty file.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import time
from typing import Awaitable, Callable

import grpc

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc
from services.errors import InvalidRequestError, NoWorkerError, ProfilerBusyError, ProfilingDisabledError
from services.grpc_codec import abort_with
from services.profiling.peers import Peer

MAX_SECONDS = 300.0
_CLOCK_PROBES = 3
# A peer answers Profile once its recording is written up: torch's export of a busy
# worker's seconds takes a while on a loaded CPU.
_EXPORT_GRACE_S = 120.0
# (seconds, with_stack) -> (Chrome trace events, activity)
Record = Callable[[float, bool], Awaitable[tuple[list, int]]]


def check_seconds(seconds: float) -> None:
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_SECONDS:
        raise InvalidRequestError(f"seconds must be in (0, {MAX_SECONDS:g}], got {seconds!r}")


class Profiler:
    """One process's profiling core, behind the gRPC Admin service and the gateway's HTTP route."""

    def __init__(self, role: str, process_id: str, enabled: bool, record: Record,
                 peers: Callable[[], Awaitable[list[Peer]]] | None = None):
        self.role, self.process_id, self.enabled = role, process_id, enabled
        self.record, self.peers = record, peers
        self._busy = False

    async def profile(self, seconds: float, fan_out: bool, with_stack: bool = True) -> list[admin_pb2.ProcessTrace]:
        """This process's trace first, then (``fan_out``) every peer's, recorded at the same time."""
        check_seconds(seconds)
        if not self.enabled:
            raise ProfilingDisabledError(f"profiling is disabled on {self.role} {self.process_id}: start it with "
                                         f"--enable-profiling (pdserve up --enable-profiling)")
        if self._busy:
            raise ProfilerBusyError(f"{self.role} {self.process_id} is already recording a profile; "
                                    f"try again after it")
        self._busy = True
        try:
            jobs = [self._own(seconds, with_stack)]
            if fan_out and self.peers is not None:
                jobs += [profile_peer(p, seconds, with_stack) for p in await self.peers()]
            return list(await asyncio.gather(*jobs))
        finally:
            self._busy = False

    async def _own(self, seconds: float, with_stack: bool) -> admin_pb2.ProcessTrace:
        try:
            events, activity = await self.record(seconds, with_stack)
        except RuntimeError as exc:  # e.g. a worker whose model is still loading
            raise NoWorkerError(f"{self.role} {self.process_id} cannot be profiled: {exc}") from None
        data = gzip.compress(json.dumps({"traceEvents": events}).encode(), compresslevel=3)
        return admin_pb2.ProcessTrace(role=self.role, process_id=self.process_id, trace_gzip=data,
                                      activity=activity)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """The thin gRPC edge over a Profiler."""

    def __init__(self, profiler: Profiler):
        self.profiler = profiler

    async def Clock(self, request, context):
        return admin_pb2.ClockResponse(wall_ns=time.time_ns())

    async def Profile(self, request: admin_pb2.ProfileRequest, context: grpc.aio.ServicerContext):
        try:
            traces = await self.profiler.profile(request.seconds, request.fan_out, not request.no_stack)
        except Exception as exc:
            await abort_with(context, exc)
        return admin_pb2.ProfileResponse(traces=traces)


async def clock_offset(stub: admin_pb2_grpc.AdminStub, timeout: float = 5.0) -> tuple[int, int]:
    """(peer wall clock minus ours, round trip) in ns, from the probe with the smallest round trip."""
    best = None
    for _ in range(_CLOCK_PROBES):
        sent = time.time_ns()
        reply = await stub.Clock(admin_pb2.ClockRequest(), timeout=timeout)
        got = time.time_ns()
        sample = (got - sent, reply.wall_ns - (sent + got) // 2)
        best = sample if best is None or sample < best else best
    rtt, offset = best
    return offset, rtt


def channel(address: str) -> grpc.aio.Channel:
    # A busy worker's trace is tens of MB even gzipped; gRPC's 4 MB default would refuse it.
    return grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30)])


async def profile_peer(peer: Peer, seconds: float, with_stack: bool = True) -> admin_pb2.ProcessTrace:
    """One peer's trace, its clock offset set; an ``error`` trace if it cannot be profiled."""
    try:
        async with channel(peer.address) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            offset, rtt = await clock_offset(stub)
            reply = await stub.Profile(admin_pb2.ProfileRequest(seconds=seconds, no_stack=not with_stack),
                                       timeout=seconds + _EXPORT_GRACE_S)
    except grpc.aio.AioRpcError as exc:
        reason = exc.details() or exc.code().name
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            reason = "this process serves no Admin service (an older pdserve?)"
        return admin_pb2.ProcessTrace(role=peer.role, process_id=peer.process_id,
                                      error=f"{exc.code().name}: {reason}")
    trace = reply.traces[0]
    trace.clock_offset_ns, trace.clock_rtt_ns = offset, rtt
    return trace


def front_profiler(role: str, redis, enabled: bool) -> Profiler:
    """The Profiler of a process without an engine (router, gateway): its spans; fan-out to every peer."""
    from services.profiling.peers import find_peers, new_process_id
    from services.profiling.recording import record_spans

    process_id = new_process_id(role)
    return Profiler(role, process_id, enabled, record_spans, lambda: find_peers(redis, process_id))


async def serve_admin(profiler: Profiler, host: str) -> tuple[grpc.aio.Server, int]:
    """A gRPC server with only Admin, on a free port: for a process whose own gRPC port may be off."""
    from services.grpc_decode import add_servicer

    server = grpc.aio.server()
    add_servicer(server, AdminServicer(profiler), admin_pb2_grpc.add_AdminServicer_to_server)
    port = server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise ValueError(f"cannot listen on {host} for the Admin service")
    await server.start()
    return server, port
