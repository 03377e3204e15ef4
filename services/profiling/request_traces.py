"""Which OpenTelemetry trace each request a worker is serving belongs to, for the torch profiler's ranges.

A worker's engine step is batched across requests, so the torch profiler's op
ranges belong to no one request. While a profile records, ``Engine.step`` wraps
each step's work (forward, sample, postprocess) in one range whose name lists
the trace ids of the sequences in it::

    requests forward_prefill: trace_id=4bf92f3577b34da6a3ce929d0e0e4736
    requests forward_decode: trace_id=4bf9...4736 trace_id=0af7...b7c1 request_id=r-17

so a request's ops are found by searching the worker's trace for its trace id:
its prefill chunks (the prefill worker runs them one step at a time) and every
decode step it was part of. The name carries the ids because torch's Chrome
export keeps a range's name but drops ``record_function``'s ``args``. A request
whose RPC carried no trace context is listed by its request id.

The gRPC handlers bind a request id to its span's trace id for as long as the
RPC runs (``telemetry.server_span``): a dict entry per request in flight, made
whether or not a profile records, so one started mid-request still names it.
Nothing is built per step unless the profiler records (``phases.profiler_recording``).
Torch-free: the router and gateway import telemetry too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

_by_request: dict[str, str] = {}  # request id -> trace id (32 lowercase hex digits)


@contextlib.contextmanager
def bound(request_id: str, trace_id: int) -> Iterator[None]:
    """``request_id`` belongs to ``trace_id`` (an OTel trace id; 0, the invalid id, binds nothing) in the block."""
    if not request_id or not trace_id:
        yield
        return
    hex_id = f"{trace_id:032x}"
    _by_request[request_id] = hex_id
    try:
        yield
    finally:
        if _by_request.get(request_id) == hex_id:  # a later RPC of the same request may have rebound it
            del _by_request[request_id]


def trace_id(request_id: str) -> str | None:
    return _by_request.get(request_id)


def range_name(kind: str, request_ids: Iterable[str]) -> str:
    """The profiler range name of one step's work for these requests (see the module's docstring)."""
    parts = []
    for rid in request_ids:
        tid = _by_request.get(rid)
        parts.append(f"trace_id={tid}" if tid else f"request_id={rid}")
    return f"requests {kind}: {' '.join(parts)}"
