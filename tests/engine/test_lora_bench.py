"""``pdserve bench lora`` end to end on a small run (dummy:tiny): what a reader of its JSON and
result file relies on, never how fast it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_json_reports_each_rank_batch_and_arm(tmp_path):
    argv = [sys.executable, "-m", "services.cli", "bench", "lora", "--model", "dummy:tiny", "--json", "--batch", "1,2",
            "--ranks", "8,16", "--rounds", "1", "--max-tokens", "4", "--threads", "1", "--save", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=580, check=False)
    assert proc.returncode == 0, f"bench lora failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)
    assert result["batches"] == [1, 2] and result["goal"] == 0.7
    assert [(c["rank"], c["batch"]) for c in result["cases"]] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    for case in result["cases"]:
        for arm in ("none", "adapters", "none_unfused"):
            assert case[arm]["tokens"] == case["batch"] * 4
            assert case[arm]["tok_per_s"] > 0 and case[arm]["cpu_tok_per_s"] > 0
        assert case["throughput_ratio"] == round(case["adapters"]["tok_per_s"] / case["none"]["tok_per_s"], 3)
        assert case["cpu_throughput_ratio"] == round(
            case["adapters"]["cpu_tok_per_s"] / case["none"]["cpu_tok_per_s"], 3)
    # dummy:tiny (hidden 64, MLP 128, 2 layers): an adapter of rank r reads r * 1024 * 2 * 2 bytes, the base
    # layers 36864 * 2 * 2; twice the batch, twice the adapter bytes
    by_case = {(c["rank"], c["batch"]): c["adapter_over_base_bytes"] for c in result["cases"]}
    assert by_case[(8, 1)] == round(8 * 1024 / 36864, 3) and by_case[(16, 2)] == round(2 * 16 * 1024 / 36864, 3)
    saved = json.loads(next(tmp_path.glob("lora-*.json")).read_text())
    assert saved["bench"] == "lora" and saved["result"] == result
