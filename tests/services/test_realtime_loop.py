"""The gateway's real-time event loop (services/realtime_loop.py), in a process of its own: on, only for the loop's
thread, and ordinary again as soon as it computes past its budget without waiting, then real-time again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio, json, os, threading, time
    from services.realtime_loop import RealtimeLoop

    def spin(seconds):  # CPU without waiting: what a busy loop (a long burst, a bug) does
        start = time.process_time()
        while time.process_time() - start < seconds:
            pass

    async def main():
        guard = RealtimeLoop(asyncio.get_running_loop(), budget_s=0.2, pause_s=0.3)
        out = {"refused": guard.start(), "policy": os.sched_getscheduler(0) & 0xFF}
        seen = []
        thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        thread.start(); thread.join()
        out["thread"] = seen[0]
        await asyncio.sleep(0.05)  # waiting is fine: the budget counts CPU between waits
        spin(1.0)
        out["after_spin"] = os.sched_getscheduler(0) & 0xFF
        out["demotions"] = guard.demotions
        await asyncio.sleep(1.0)
        out["after_pause"] = os.sched_getscheduler(0) & 0xFF
        spin(0.5)  # past the budget again: ordinary again
        guard._again()  # the pause's end while the loop is still busy: the count starts afresh
        spin(0.1)  # under the budget
        out["busy_again"] = os.sched_getscheduler(0) & 0xFF
        out["demotions_end"] = guard.demotions
        print(json.dumps(out))

    asyncio.run(main())
""")


def test_the_loop_thread_is_real_time_until_it_stops_waiting_then_ordinary_for_a_while():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["refused"]:  # no CAP_SYS_NICE or no real-time budget here: said in one line, nothing changed
        assert out["refused"].startswith("real-time scheduling not applied (")
        assert out["policy"] == out["thread"] == out["after_spin"] == 0 and out["demotions"] == 0
        return
    assert out["policy"] == 2  # SCHED_RR
    assert out["thread"] == 0  # threads it starts are ordinary (SCHED_RESET_ON_FORK)
    assert out["after_spin"] == 0 and out["demotions"] == 1  # 1 s without waiting: past the 0.2 s budget
    assert "ran 0.2 s of CPU without waiting" in proc.stderr
    assert out["after_pause"] == 2  # real time again after the pause
    # brought back while busy, it is not put back to ordinary for CPU it used before (the count restarts)
    assert out["busy_again"] == 2 and out["demotions_end"] == 2
