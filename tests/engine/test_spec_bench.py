"""``pdserve bench spec`` end to end on a small workload with the real default model: what a
reader of its JSON and result file relies on, never how fast it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_json_reports_both_workloads_with_and_without_speculation(tmp_path):
    argv = [sys.executable, "-m", "services.cli", "bench", "spec", "--json", "--prompts", "2", "--max-tokens", "24",
            "--batches", "1", "2", "--cost-steps", "2", "--save", str(tmp_path),
            "--threads", "1"]  # on a shared CPU, two threads' barriers made this 7x slower (near the timeout)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=580, check=False)
    assert proc.returncode == 0, f"bench spec failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)  # stdout is exactly one JSON object; progress goes to stderr
    for name in ("grounded", "open"):
        for batch in (1, 2):
            case = result[f"{name}_b{batch}"]
            assert case["requests"] == 2 and case["batch"] == batch
            assert case["base_tok_s"] > 0 and case["spec_tok_s"] > 0
            assert result[f"{name}_b{batch}_speedup"] == case["speedup"]
            # the ratio of the unrounded rates: within what rounding each rate to 0.1 allows
            spec, base = case["spec_tok_s"], case["base_tok_s"]
            assert (spec - 0.05) / (base + 0.05) - 0.001 <= case["speedup"] <= (spec + 0.05) / (base - 0.05) + 0.001
    assert result["grounded_b1_speedup"] and result["open_b1_speedup"]
    grounded = result["grounded_b1"]
    assert grounded["acceptance_rate"] > 0.3 and grounded["mean_accepted_length"] > 1.5  # copying pays
    assert grounded["accepted_tokens"] <= grounded["draft_tokens"]
    assert set(result["step_ms_b1"]) == {"0", "1", "3", "5"} and result["break_even_tokens_per_step_b1"] > 0
    saved = json.loads(next(tmp_path.glob("spec-*.json")).read_text())
    assert saved["bench"] == "spec" and saved["result"] == result and saved["machine"]["cpu_model"]


@pytest.mark.parametrize("flags, names", [(["--batches", "0"], "--batches"), (["--prompts", "x"], "--prompts"),
                                          (["--dtype", "fp8"], "fp8")])
def test_bad_flags_are_a_clear_error(flags, names):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "spec", *flags],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2  # argparse's usage error, before any model loads
    assert names in proc.stderr and "Traceback" not in proc.stderr
