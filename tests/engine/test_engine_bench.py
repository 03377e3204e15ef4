"""``pdserve bench engine`` end to end on a tiny workload, with the real default model and
HF transformers: what a reader of its JSON relies on, never how fast it was."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_json_compares_both_sides_on_one_workload():
    argv = [sys.executable, "-m", "services.cli", "bench", "engine", "--json", "--requests", "2",
            "--decode-tokens", "4"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, f"bench engine failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)  # stdout is exactly one JSON object; progress goes to stderr
    assert result["requests"] == 2 and result["dtype"] == "bfloat16"
    assert result["hf_batch_size"] == 64  # HF at its fastest static batch on the project's CPU
    for key in ("pdserve_tok_s", "hf_tok_s", "pdserve_decode_b1_tok_s", "hf_decode_b1_tok_s"):
        assert result[key] > 0, key
    assert result["throughput_ratio_vs_hf"] == pytest.approx(result["pdserve_tok_s"] / result["hf_tok_s"], abs=0.01)
    assert result["decode_b1_ratio_vs_hf"] == pytest.approx(
        result["pdserve_decode_b1_tok_s"] / result["hf_decode_b1_tok_s"], abs=0.01)
    if importlib.util.find_spec("llama_cpp") is not None:  # its column, or why it is missing (a crashing build)
        assert result.get("llama_cpp_tok_s", 0) > 0 or result["llama_cpp_error"]


@pytest.mark.parametrize("flags, names", [(["--dtype", "fp8"], "fp8"), (["--requests", "0"], "--requests"),
                                          (["--hf-batch-size", "x"], "--hf-batch-size")])
def test_bad_flags_are_a_clear_error(flags, names):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "engine", *flags],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2  # argparse's usage error, before any model loads
    assert names in proc.stderr and "Traceback" not in proc.stderr
