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
            "--ranks", "8,16", "--rounds", "1", "--max-tokens", "4", "--threads", "1", "--lora-dtype", "bf16,int8,int4",
            "--accuracy-prompts", "1", "--save", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=580, check=False)
    assert proc.returncode == 0, f"bench lora failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)
    assert result["batches"] == [1, 2] and result["goal"] == 0.7 and result["lora_dtypes"] == ["bf16", "int8", "int4"]
    assert [(c["rank"], c["batch"]) for c in result["cases"]] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    for case in result["cases"]:
        for arm in ("none", "adapters:bf16", "adapters:int8", "adapters:int4", "none_unfused"):
            assert case[arm]["tokens"] == case["batch"] * 4
            assert case[arm]["tok_per_s"] > 0 and case[arm]["cpu_tok_per_s"] > 0
        for d, by in case["by_lora_dtype"].items():
            arm = case[f"adapters:{d}"]
            assert by["throughput_ratio"] == round(arm["tok_per_s"] / case["none"]["tok_per_s"], 3)
            assert by["cpu_throughput_ratio"] == round(arm["cpu_tok_per_s"] / case["none"]["cpu_tok_per_s"], 3)
    # dummy:tiny (hidden 64, MLP 128, 2 layers): an adapter of rank r holds r * 1024 * 2 weights, the base
    # layers 36864 * 2 bf16 weights; twice the batch, twice the adapter bytes; int8 half of bf16's, int4
    # 0.5625 / 2 of it (a bf16 scale per 32)
    by_case = {(c["rank"], c["batch"]): c["by_lora_dtype"] for c in result["cases"]}
    assert by_case[(8, 1)]["bf16"]["adapter_over_base_bytes"] == round(8 * 1024 / 36864, 3)
    assert by_case[(16, 2)]["bf16"]["adapter_bytes_per_step"] == 2 * 16 * 1024 * 2 * 2
    assert by_case[(16, 2)]["int8"]["adapter_bytes_per_step"] == 2 * 16 * 1024 * 2
    assert by_case[(16, 2)]["int4"]["adapter_bytes_per_step"] == round(2 * 16 * 1024 * 2 * 0.5625)
    # accuracy beside the speed: per rank, the base model and each lora dtype against HF / PEFT
    assert [(a["rank"], a["lora_dtype"]) for a in result["accuracy"]] == [
        (r, d) for r in (8, 16) for d in ("none", "bf16", "int8", "int4")]
    for a in result["accuracy"]:
        assert a["prompts"] == 1 and len(a["first_divergence"]) == 1 and a["max_abs_logit_diff"] >= 0
    saved = json.loads(next(tmp_path.glob("lora-*.json")).read_text())
    assert saved["bench"] == "lora" and saved["result"] == result
