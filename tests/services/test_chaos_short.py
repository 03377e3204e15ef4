"""The short form of `pdserve bench chaos`: every scenario on the real stack, a few requests each, goals met.

The full run (>= 500 requests) is in BENCHMARKS.md; this one keeps each fault
path honest in CI: nothing lost, no duplicate or missing token, no leaked block,
no 5xx for bad input, and the stack back on its feet after every fault.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.bench.chaos import SCENARIOS

pytestmark = pytest.mark.slow


def test_every_chaos_scenario_loses_nothing_and_leaks_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "chaos", "--json", "--requests", str(3 * len(SCENARIOS)),
         "--capacity-requests", "4", "--overload-s", "3", "--stall-s", "4", "--deadline", "150",
         "--idle-timeout", "60", "--kv-cache-gb", "0.25", "--transfer-timeout", "6", "--claim-idle-ms", "5000"],
        capture_output=True, text=True, timeout=560, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["scenarios"]) == set(SCENARIOS)
    said = proc.stderr[-4000:]  # the bench's per-scenario lines: what was lost, and how
    for name, s in result["scenarios"].items():
        assert s["requests_completed"] > 0, (name, s, said)
        for goal in ("duplicate_tokens", "token_gaps", "leaked_blocks", "bad_input_5xx"):
            assert s[goal] == 0, (name, goal, s, said)
        assert s["requests_lost"] == 0, (name, s["lost_detail"], said)
    # every malformed request is answered with a 4xx, the body over the size cap included (it used to
    # meet a reset connection while the client was still uploading it)
    unanswered = {case for case in result["scenarios"]["bad-input"]["bad_input_statuses"]
                  if case.endswith(": 0") or int(case.rsplit(": ", 1)[1]) >= 500}
    assert unanswered == set(), unanswered
    assert result["scenarios"]["client-disconnect"]["resumed_streams"] > 0
    assert result["scenarios"]["bad-input"]["bad_input_requests"] > 0
    transfer = result["scenarios"]["transfer-fault"]
    assert transfer["timeouts_injected"] > 0 and transfer["corruptions_injected"] > 0
    assert transfer["corruptions_caught"] == transfer["corruptions_injected"]
    assert result["restarts"] >= 3  # decode, prefill and router each killed and started again
    assert proc.returncode == (0 if result["goals_met"] else 1), proc.stderr[-4000:]
