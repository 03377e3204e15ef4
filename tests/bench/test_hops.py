"""The hop probe (services/hops.py) and how ``pdserve bench hops`` splits a first token's path."""

from __future__ import annotations

import json

from services import hops
from services.bench.hops import split, summarize_level
from services.bench.load import Sample


def _write(directory, pid: int, records: list[dict]) -> None:
    with open(directory / f"{pid}.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_marks_from_every_process_join_by_request_id_with_counts(tmp_path):
    _write(tmp_path, 1, [{"rid": "a", "hop": "gw.arrive", "t": 100}, {"rid": "a", "hop": "gw.sse", "t": 900}])
    _write(tmp_path, 2, [{"rid": "a", "hop": "decode.recv", "t": 500, "step": 7},
                         {"rid": "a", "hop": "decode.recv", "t": 400, "step": 6}])
    (tmp_path / "3.jsonl").write_text('{"rid": "a", "hop": "router.re')  # a process killed mid-line
    marks = hops.read(str(tmp_path))
    assert set(marks) == {"a"}
    assert marks["a"]["decode.recv"]["t"] == 400 and marks["a"]["decode.recv"]["n"] == 2  # the first, twice
    assert marks["a"]["gw.arrive"]["n"] == 1


def test_client_id_strips_the_attempt_only():
    assert hops.client_id("gw-0123abcd.ff00.2") == "gw-0123abcd.ff00"
    assert hops.client_id("gw-0123abcd.ff00") == "gw-0123abcd.ff00"  # no attempt suffix: as it is
    assert hops.client_id("plain") == "plain"


def _ms(**hops_ms):
    return {hop: {"t": int(ms * 1e6)} for hop, ms in hops_ms.items()}


def test_a_local_prefill_is_one_chain():
    m = _ms(**{"gw.arrive": 0, "gw.enqueue": 1, "gw.queued": 3, "router.read": 2, "router.placed": 2.5,
               "router.sent": 2.6, "decode.recv": 3.6, "decode.token": 20, "decode.written": 21,
               "gw.delivered": 22, "gw.sse": 22.5})
    got = split(m)
    assert got["gw.enqueue->router.read"] == 1.0  # the queue write's reply is beside the path
    assert got["gw.enqueue->gw.queued"] == 2.0
    assert got["router.sent->decode.recv"] == 1.0 and got["decode.recv->decode.token"] == 16.4
    assert got["total"] == 22.5 and min(got.values()) >= 0


def test_a_hand_off_goes_through_the_prefill_worker_and_the_kv():
    m = _ms(**{"gw.arrive": 0, "gw.enqueue": 1, "router.read": 2, "router.placed": 3, "router.sent": 4,
               "prefill.recv": 5, "decode.recv": 6, "prefill.done": 30, "decode.kv": 32, "decode.token": 40,
               "decode.written": 41, "gw.delivered": 42, "gw.sse": 43})
    got = split(m)
    assert "prefill.recv->decode.kv" in got and "decode.kv->decode.token" in got
    assert got["prefill.recv->prefill.done"] == 25.0  # beside the path: the send's completion
    assert got["router.sent->decode.recv"] == 2.0  # the Decode call made while the prefill computes
    assert "decode.recv->decode.token" not in got and "prefill.done->decode.recv" not in got


def test_level_summary_counts_steps_from_the_kv_and_clock_violations():
    marks = {"r1": {**_ms(**{"gw.arrive": 0, "router.read": 2, "gw.sse": 1}),
                    "decode.recv": {"t": 0, "step": 3}, "decode.token": {"t": 0, "step": 5}},
             "r2": {"prefill.recv": {"t": 0}, "decode.recv": {"t": 0, "step": 1}, "decode.kv": {"t": 0, "step": 9},
                    "decode.token": {"t": 0, "step": 10}}}
    samples = [Sample(True, 0.01, 0.02, [], 4, request_id="r1"), Sample(True, 0.01, 0.02, [], 4, request_id="r2")]
    level = summarize_level(samples, marks)
    assert level["engine_steps_to_first_token"] == {"p50": 1.5, "max": 2}
    assert level["via_prefill_worker"] == 1 and level["traced"] == 2
    assert level["clock_violations"] == 1  # r1's gw.sse before router.read


def test_wakeups_count_every_thread_of_a_process():
    """bench hops' wake-ups per token: a thread other than the main one that sleeps 50 times is counted (psutil's
    own count reads the main thread's only)."""
    import os
    import threading
    import time

    import psutil

    from services.bench.process_watch import wakeups

    me = {"me": psutil.Process(os.getpid())}
    slept, done = threading.Event(), threading.Event()

    def sleeper():
        for _ in range(50):
            time.sleep(0.001)
        slept.set()
        done.wait()  # alive while counted: a thread that exited takes its count with it (as in the stack's
        # processes, whose threads live as long as they do)

    before = wakeups(me)["me"]
    worker = threading.Thread(target=sleeper)
    worker.start()
    slept.wait()
    after = wakeups(me)["me"]
    done.set()
    worker.join()
    assert after - before >= 50
