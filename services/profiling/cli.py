"""``pdserve profile``: record every process of a running stack for a few seconds.

    pdserve up --enable-profiling --kv-cache-gb 0.25 &
    pdserve profile --seconds 5 --out profile/           # while requests run
    # profile/gateway-*.json router-*.json prefill-*.json decode-*.json merged.json
    # open merged.json in https://ui.perfetto.dev (or chrome://tracing)

The router (``--address``, as for ``pdserve client``) records itself and asks every
worker and gateway to record at the same time (Admin.Profile with fan_out); the
traces come back with each process's clock offset from the router's, and are
written aligned. An idle stack, or one started without --enable-profiling, gets a
message and a non-zero exit, not empty files.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc
from services.profiling import merge
from services.profiling.admin import MAX_SECONDS, channel, check_seconds

_GRACE_S = 180.0  # export and transfer of the traces after the recording


async def fetch(address: str, seconds: float, with_stack: bool = True) -> list[admin_pb2.ProcessTrace]:
    async with channel(address) as ch:
        reply = await admin_pb2_grpc.AdminStub(ch).Profile(
            admin_pb2.ProfileRequest(seconds=seconds, fan_out=True, no_stack=not with_stack),
            timeout=seconds + _GRACE_S)
    return list(reply.traces)


def write(out: Path, traces: list[admin_pb2.ProcessTrace]) -> list[tuple[Path, int]]:
    """Each process's aligned trace and merged.json; returns (path, events) per file written."""
    merged, per_process = merge.align(traces)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, document in [*per_process.items(), ("merged.json", merged)]:
        path = out / name
        path.write_text(json.dumps(document))
        written.append((path, len(document["traceEvents"])))
    return written


def run(args) -> int:
    check_seconds(args.seconds)  # a ValueError: the CLI's usage error (exit 2)
    print(f"[pdserve] recording every process behind {args.address} for {args.seconds:g} s ...", flush=True)
    try:
        traces = asyncio.run(fetch(args.address, args.seconds, not args.no_stack))
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            print(f"error: cannot reach a router at {args.address}: {exc.details()}", file=sys.stderr)
        elif code == grpc.StatusCode.UNIMPLEMENTED:
            print(f"error: {args.address} serves no Admin service (is it a pdserve router?)", file=sys.stderr)
        else:
            print(f"error: {exc.details() or code.name}", file=sys.stderr)
        return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    failed = [t for t in traces if t.error]
    recorded = [t for t in traces if not t.error]
    for t in failed:
        print(f"  {t.role} {t.process_id}: not profiled: {t.error}", file=sys.stderr)
    if not any(t.activity for t in recorded):
        print(f"error: nothing to record: no process served a request in the {args.seconds:g} s window "
              f"(the stack was idle); send requests while profiling. No files written.", file=sys.stderr)
        return 1
    for path, count in write(Path(args.out), recorded):
        trace = next((t for t in recorded if merge.file_name(t) == path.name), None)
        detail = (f"activity {trace.activity}, clock offset {trace.clock_offset_ns / 1e3:+.0f} us "
                  f"+- {trace.clock_rtt_ns / 2e3:.0f} us") if trace else f"{len(recorded)} processes"
        print(f"  {path}  {count} events  ({detail})")
    print("[pdserve] open merged.json in https://ui.perfetto.dev", flush=True)
    if failed:
        print(f"error: {len(failed)} of {len(traces)} processes were not profiled (see above)", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="record a running stack's processes (torch profiler, spans) for S seconds",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help=f"how long to record, up to {MAX_SECONDS:g}")
    p.add_argument("--out", default="profile", help="directory for the traces (created)")
    p.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC address")
    p.add_argument("--no-stack", action="store_true",
                   help="leave out the workers' Python stacks (traces about ten times smaller, exported faster)")
    p.set_defaults(func=run)
