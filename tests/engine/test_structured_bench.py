"""``pdserve bench structured`` end to end on a small run with the real default model: what a
reader of its JSON and result file relies on, never how fast it was."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_json_reports_overhead_compile_and_validity(tmp_path):
    argv = [sys.executable, "-m", "services.cli", "bench", "structured", "--json", "--batches", "1", "2",
            "--rounds", "1", "--steps", "6", "--max-tokens", "24", "--threads", "1", "--save", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=580, check=False)
    assert proc.returncode == 0, f"bench structured failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)
    assert result["schemas"] >= 20 and result["compile"]["schemas"] == result["schemas"]
    assert result["compile"]["cached_ms_p50"] < result["compile"]["cold_ms_p50"]  # a dict lookup vs a compile
    for batch in (1, 2):
        case = result[f"overhead_b{batch}"]
        assert case["batch"] == batch and case["steps_free"] > 0 and case["steps_constrained"] > 0
        for clock in ("wall", "cpu"):
            ratio = case[f"{clock}_ms_constrained_p50"] / case[f"{clock}_ms_free_p50"] - 1
            assert abs(ratio - case[f"{clock}_overhead"]) < 1e-3
    v = result["validity"]
    assert v["outputs"] == result["schemas"] == len(v["per_schema"])
    assert v["valid"] + v["cut_by_max_tokens"] >= v["outputs"]  # every output that ended on its own validates
    for case in v["per_schema"]:
        if case["finish_reason"] == "stop":
            assert case["valid"] and isinstance(json.loads(case["output"]), dict)
    saved = json.loads(next(tmp_path.glob("structured-*.json")).read_text())
    assert saved["bench"] == "structured" and saved["result"] == result


def test_schemas_are_valid_json_schemas():
    from services.engine.structured_bench import load_schemas

    schemas = load_schemas()
    assert len(schemas) >= 20 and len({s["name"] for s in schemas}) == len(schemas)
    for case in schemas:
        jsonschema.Draft202012Validator.check_schema(case["schema"])
        assert case["prompt"]
