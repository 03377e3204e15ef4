"""Where ``bench frontdoor``'s added latency per chunk goes: the gateway's probe joined with the two readers.

Each chunk compared has four times on this machine's clock:

    tapped   it reached the socket of a separate process reading Redis directly   (result_tap.py)
    read     the gateway's delivery reader's XREAD that carried it returned        (fanout_probe.py)
    written  its SSE event was handed to the HTTP server                           (fanout_probe.py)
    client   it reached the load generator's socket                                (http_client.py)

(``tapped`` and ``client`` are the kernel's receive stamps, socket_time.py), so
the added latency (client - tapped) splits into ``delivery`` (read - tapped:
the delivery stream through Redis, and the gateway's loop being free to run
the reader), ``gateway`` (written - read: the subscription's wake-up, the
formatting and the HTTP server's write, all waiting their turn on the gateway's
loop) and ``client`` (client - written: the loopback socket; the load
generator's own lateness in reading is not in it, the bench reports it apart). For the slowest chunks (the top 1% by added latency)
it says which part dominated. Beside it, both event loops' lag and the
gateway's and the load generator's garbage-collector pauses: a loop that wakes 200 ms late delays every
chunk waiting on it by as much.
"""

from __future__ import annotations

from collections import Counter

from services.bench.stats import percentile as pct

PARTS = ("delivery", "gateway", "client")


def _spread(values: list[float]) -> dict:
    return {"p50": round(pct(values, 50), 2), "p90": round(pct(values, 90), 2), "p99": round(pct(values, 99), 2),
            "max": round(max(values), 2) if values else None, "n": len(values)}


def lag_summary(samples: list, since: float, until: float) -> dict:
    """A loop's lag (ms late per tick) within [since, until], and how many ticks were 20 / 100 ms late."""
    lags = [late for at, late in samples if since <= at <= until]
    return {**_spread(lags), "ticks_over_20ms": sum(v > 20 for v in lags),
            "ticks_over_100ms": sum(v > 100 for v in lags),
            "late_ms_total": round(sum(v for v in lags if v > 5), 1)}


def gc_summary(pauses: list, since: float, until: float) -> dict:
    within = [(gen, ms) for at, gen, ms in pauses if since <= at <= until]
    by_gen = {}
    for gen in sorted({g for g, _ in within}):
        ms = [m for g, m in within if g == gen]
        by_gen[str(gen)] = {"count": len(ms), "ms_total": round(sum(ms), 1), "ms_max": round(max(ms), 1)}
    return by_gen


def write_order(rows: list[dict]) -> dict:
    """Whether the gateway writes one delivery read's chunks in the order it read them (oldest first), and how long
    writing out one read takes: per read of two or more joined chunks, the time from its first chunk written to
    its last (``span_ms``), and the share of successive chunks (by place in the read) written in that order."""
    by_read: dict[float, list[dict]] = {}
    for r in rows:
        if r["position"] is not None:
            by_read.setdefault(r["read_at"], []).append(r)
    spans, in_order, pairs = [], 0, 0
    for group in by_read.values():
        if len(group) < 2:
            continue
        group.sort(key=lambda r: r["position"])
        times = [r["written"] for r in group]
        spans.append((max(times) - min(times)) * 1e3)
        in_order += sum(b >= a for a, b in zip(times, times[1:]))
        pairs += len(times) - 1
    return {"reads": len(spans), "span_ms": _spread(spans),
            "in_read_order_share": round(in_order / pairs, 3) if pairs else None}


def breakdown(chunks: list[tuple[str, str, float, float]], probe: dict, client_lag: list,
              since: float, until: float, client_gc: list = ()) -> dict:
    """``chunks``: (request id, entry id, tapped, client) of the chunks compared; ``probe``: fanout_probe.load();
    ``client_lag``, ``client_gc``: the load generator's LoopLag samples and GC pauses; [since, until]: the
    steady window (unix times)."""
    reads = {(rid, eid): (at, batch, *rest[:1]) for rid, eid, at, batch, *rest in probe["reads"]}
    writes = {(rid, eid): at for rid, eid, at in probe["writes"]}
    rows = []
    for rid, eid, tapped, client in chunks:
        read, written = reads.get((rid, eid)), writes.get((rid, eid))
        if read is None or written is None:
            continue
        rows.append({"added": (client - tapped) * 1e3, "delivery": (read[0] - tapped) * 1e3,
                     "gateway": (written - read[0]) * 1e3, "client": (client - written) * 1e3, "batch": read[1],
                     "read_at": read[0], "position": read[2] if len(read) > 2 else None, "written": written})
    out = {"chunks_joined": len(rows), "chunks_unjoined": len(chunks) - len(rows)}
    for part in ("added", *PARTS):
        out[f"{part}_ms"] = _spread([r[part] for r in rows])
    if rows:
        tail = sorted(rows, key=lambda r: r["added"])[-max(1, len(rows) // 100):]
        out["slowest_1pct"] = {
            "chunks": len(tail),
            "mean_ms": {part: round(sum(r[part] for r in tail) / len(tail), 1) for part in ("added", *PARTS)},
            "dominant_part": dict(Counter(max(PARTS, key=lambda p: r[p]) for r in tail)),
            "batch_p50": pct([r["batch"] for r in tail], 50),
        }
    out["write_order"] = write_order(rows)
    batches = [r["batch"] for r in rows]
    out["xread_entries_per_batch"] = _spread(batches)
    out["gateway_loop_lag_ms"] = lag_summary(probe["lag"], since, until)
    out["client_loop_lag_ms"] = lag_summary(client_lag, since, until)
    out["gateway_gc_pauses"] = gc_summary(probe["gc"], since, until)
    out["client_gc_pauses"] = gc_summary(list(client_gc), since, until)
    return out
