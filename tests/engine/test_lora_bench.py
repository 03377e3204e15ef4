"""``pdserve bench lora`` end to end on a small run (dummy:tiny): what a reader of its JSON and
result file relies on, never how fast it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_json_reports_each_rank_and_arm(tmp_path):
    argv = [sys.executable, "-m", "services.cli", "bench", "lora", "--model", "dummy:tiny", "--json", "--batch", "2",
            "--ranks", "8,16", "--rounds", "1", "--max-tokens", "4", "--threads", "1", "--save", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=580, check=False)
    assert proc.returncode == 0, f"bench lora failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)
    assert result["batch"] == 2 and result["goal"] == 0.7
    for rank in (8, 16):
        case = result[f"rank{rank}"]
        for arm in ("none", "adapters", "none_unfused"):
            assert case[arm]["tokens"] == 2 * 4 and case[arm]["tok_per_s"] > 0
        assert case["throughput_ratio"] == round(case["adapters"]["tok_per_s"] / case["none"]["tok_per_s"], 3)
    saved = json.loads(next(tmp_path.glob("lora-*.json")).read_text())
    assert saved["bench"] == "lora" and saved["result"] == result
