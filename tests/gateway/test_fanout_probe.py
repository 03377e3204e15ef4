"""The gateway's fan-out probe (fanout_probe.py) and the breakdown ``bench frontdoor`` makes of it."""

from __future__ import annotations

import gc

import httpx

from services.gateway import fanout_probe, frontdoor_probe
from tests.gateway.fake_router import Plan
from tests.gateway.harness import wait_for
from tests.gateway.sse_client import events

PIECES = tuple(f"w{i} " for i in range(6))


def test_every_streamed_chunk_is_timed_where_it_was_read_and_where_it_went_out(gateway, tmp_path, monkeypatch):
    monkeypatch.setattr(fanout_probe, "_dir", str(tmp_path))
    monkeypatch.setattr(fanout_probe, "_probe", None)
    h = gateway()
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.02)
    with httpx.Client(base_url=h.url, timeout=20) as http, http.stream(
            "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "stream": True}) as r:
        rid = r.headers["x-request-id"]
        ids = [e.id for e in events(r) if e.id]
    chunk_ids = set(ids[1:len(PIECES) + 1])  # after the opening, one event per piece
    got: dict = {}

    def flushed() -> bool:  # the probe appends what is new every second
        got.update(fanout_probe.load(str(tmp_path)))
        return {eid for r_, eid, *_ in got["writes"] if r_ == rid} >= chunk_ids

    assert wait_for(flushed, timeout_s=10), got
    reads = {eid: at for r_, eid, at, batch, position in got["reads"] if r_ == rid and 0 <= position < batch}
    writes = {eid: at for r_, eid, at in got["writes"] if r_ == rid}
    assert chunk_ids <= set(reads)
    assert all(reads[eid] <= writes[eid] for eid in chunk_ids)  # read from the inbox before it went out
    assert got["lag"], "the loop-lag ticker ran"


def test_probe_off_records_nothing(gateway, tmp_path, monkeypatch):
    monkeypatch.setattr(fanout_probe, "_dir", None)
    monkeypatch.setattr(fanout_probe, "_probe", None)
    h = gateway()
    h.router.plan = lambda req: Plan(pieces=PIECES, delay_s=0.0)
    with httpx.Client(base_url=h.url, timeout=20) as http:
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}).status_code \
            == 200
    assert fanout_probe._probe is None and not list(tmp_path.iterdir())


def test_breakdown_splits_added_latency_and_names_what_dominated_the_slowest():
    # 200 chunks: 198 quick ones; two slow ones, one held in the gateway, one late to the client
    chunks, reads, writes = [], [], []
    for i in range(200):
        tapped = 1000.0 + i
        read, written, client = tapped + 0.001, tapped + 0.002, tapped + 0.003
        if i == 7:
            written, client = read + 0.5, read + 0.501
        if i == 9:
            client = written + 0.3
        chunks.append(("r", f"{i}-0", tapped, client))
        reads.append(("r", f"{i}-0", read, 4, 0))
        writes.append(("r", f"{i}-0", written))
    chunks.append(("r", "999-0", 2000.0, 2000.1))  # the probe missed it: not joined, counted
    probe = {"reads": reads, "writes": writes, "lag": [(1001.0, 2.0), (1002.0, 150.0), (5000.0, 900.0)],
             "gc": [(1003.0, 2, 40.0), (1004.0, 0, 1.0)]}
    out = frontdoor_probe.breakdown(chunks, probe, [(1001.0, 0.5)], since=1000.0, until=1300.0,
                                    client_gc=[(1005.0, 2, 90.0), (999.0, 2, 50.0)])
    assert out["chunks_joined"] == 200 and out["chunks_unjoined"] == 1
    assert out["slowest_1pct"]["chunks"] == 2
    assert out["slowest_1pct"]["dominant_part"] == {"gateway": 1, "client": 1}
    assert round(out["gateway_ms"]["max"]) == 500 and round(out["client_ms"]["max"]) == 300
    assert out["gateway_loop_lag_ms"]["ticks_over_100ms"] == 1  # the 900 ms tick is outside the window
    assert out["gateway_gc_pauses"]["2"] == {"count": 1, "ms_total": 40.0, "ms_max": 40.0}
    assert out["client_gc_pauses"] == {"2": {"count": 1, "ms_total": 90.0, "ms_max": 90.0}}  # 999.0: before


def test_write_order_says_whether_one_reads_chunks_went_out_oldest_first_and_how_long_they_took():
    # two reads of three chunks at 10.0 and 20.0: the first written in read order over 4 ms, the second's
    # last-read chunk written first
    rows = []
    for read_at, written in ((10.0, (10.001, 10.003, 10.005)), (20.0, (20.004, 20.006, 20.002))):
        for position, at in enumerate(written):
            rows.append({"read_at": read_at, "position": position, "written": at})
    rows.append({"read_at": 30.0, "position": 0, "written": 30.1})  # a read of one chunk: no order to speak of
    out = frontdoor_probe.write_order(rows)
    assert out["reads"] == 2 and out["in_read_order_share"] == 0.75  # 3 of the 4 successive pairs
    assert round(out["span_ms"]["max"]) == 4 and round(out["span_ms"]["p50"]) == 4


def test_the_load_generators_quiet_collector_runs_no_full_collection_and_restores_pythons_after():
    from services.gateway.frontdoor_bench import client_gc

    before = gc.get_threshold()

    def full_collections_while_keeping_records(mode: str) -> int:
        full = []

        def note(phase, info):
            if phase == "start" and info["generation"] == 2:
                full.append(info)

        with client_gc(mode):  # entering collects once on purpose: only what runs while records pile up counts
            gc.callbacks.append(note)
            try:
                records = []
                for i in range(300_000):  # the chunk records a latency phase keeps: enough for full collections
                    records.append((f"r{i}", [i]))
            finally:
                gc.callbacks.remove(note)
        return len(full)

    assert full_collections_while_keeping_records("quiet") == 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert full_collections_while_keeping_records("default") > 0  # Python's collector does run them here
