"""One Chrome/Perfetto trace per process and a merged timeline, on one clock.

Every process records on its own Unix wall clock (workers shift the torch
profiler's clock onto it with a mark, services/profiling/recording.py). The
fan-out caller measured each peer's offset from its own clock (NTP-style: the
Clock probe with the smallest round trip, offset = peer time - midpoint), so::

    aligned_ts = ts - clock_offset_ns / 1000 - origin_us

where ``origin_us`` is the earliest aligned timestamp of the whole recording,
subtracted so Perfetto shows small numbers at full precision (doubles lose
sub-microsecond steps at Unix-epoch microseconds). The origin and each process's
offset and its uncertainty (half the probe's round trip) go in ``otherData``.
"""

from __future__ import annotations

import gzip
import json

from proto.pdserve.v1 import admin_pb2

_ORDER = {"gateway": 0, "router": 1, "prefill": 2, "decode": 3}


def decode(trace: admin_pb2.ProcessTrace) -> list[dict]:
    return json.loads(gzip.decompress(trace.trace_gzip))["traceEvents"]


def file_name(trace: admin_pb2.ProcessTrace) -> str:
    return f"{trace.role}-{trace.process_id}.json"


def align(traces: list[admin_pb2.ProcessTrace]) -> tuple[list[dict], dict[str, dict]]:
    """The merged timeline, and each trace on the caller's clock keyed by its file name."""
    decoded = [decode(t) for t in traces]
    starts = [e["ts"] - t.clock_offset_ns / 1e3 for t, events in zip(traces, decoded) for e in events if "ts" in e]
    origin = min(starts) if starts else 0.0
    per_process, merged = {}, []
    clocks = []
    for pid, (trace, events) in enumerate(zip(traces, decoded), start=1):
        shift = -trace.clock_offset_ns / 1e3 - origin
        label = f"{trace.role} {trace.process_id}"
        own = [e for e in events if not (e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index"))]
        for event in own:
            if "ts" in event:
                event["ts"] = round(event["ts"] + shift, 3)
        meta = [{"ph": "M", "name": "process_name", "pid": None, "args": {"name": label}},
                {"ph": "M", "name": "process_sort_index", "pid": None,
                 "args": {"sort_index": _ORDER.get(trace.role, 9) * 100 + pid}}]
        clock = {"process": label, "clock_offset_ns": trace.clock_offset_ns,
                 "uncertainty_ns": trace.clock_rtt_ns // 2, "activity": trace.activity}
        clocks.append(clock)
        per_process[file_name(trace)] = _document(own + [dict(m, pid=_os_pid(own)) for m in meta], origin, [clock])
        # In the merge each process gets its own pid: two hosts may reuse an OS pid.
        merged += [dict(e, pid=pid) for e in own] + [dict(m, pid=pid) for m in meta]
    return _document(merged, origin, clocks), per_process


def _os_pid(events: list[dict]) -> int:
    return next((e["pid"] for e in events if isinstance(e.get("pid"), int)), 0)


def _document(events: list[dict], origin_us: float, clocks: list[dict]) -> dict:
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"pdserve_origin_unix_us": origin_us, "pdserve_clocks": clocks}}
