"""``pdserve bench engine`` end to end on a tiny workload, with the real default model, HF
transformers in both dtypes and (when installed) llama.cpp: what a reader of its JSON relies on,
never how fast it was."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_json_compares_every_side_on_one_workload():
    argv = [sys.executable, "-m", "services.cli", "bench", "engine", "--json", "--requests", "2",
            "--decode-tokens", "4", "--ppl-tokens", "64", "--hf-batch-sizes", "1,2", "--llamacpp-seqs", "2", "--kv-context", "96",
            "--max-output-tokens", "8"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=880, check=False)
    assert proc.returncode == 0, f"bench engine failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    r = json.loads(proc.stdout)  # stdout is exactly one JSON object; progress goes to stderr
    assert r["requests"] == 2 and r["dtype"] == "bfloat16" and r["cpu"] and r["cpu_kernels"]
    assert r["max_output_tokens"] == 8 and 2 <= r["output_tokens"] <= 16  # the cap reached every side's workload
    # HF: both dtypes, every batch size, the best of them is the baseline
    hf = r["hf"]
    assert {(x["dtype"], x["batch_size"]) for x in hf["runs"]} == {(d, b) for d in ("float32", "bfloat16") for b in (1, 2)}
    assert hf["best"]["tok_s"] == max(x["tok_s"] for x in hf["runs"]) == r["hf_best_tok_s"]
    assert r["hf_tok_s"] == max(x["tok_s"] for x in hf["runs"] if x["dtype"] == "bfloat16")
    assert set(hf["decode_b1"]) == {"float32", "bfloat16"} and r["hf_best_decode_b1_tok_s"] == max(hf["decode_b1"].values())
    for key, num, den in [("throughput_ratio_vs_hf_best", "pdserve_tok_s", "hf_best_tok_s"),
                          ("throughput_ratio_vs_hf", "pdserve_tok_s", "hf_tok_s"),
                          ("decode_b1_ratio_vs_hf_best", "pdserve_decode_b1_tok_s", "hf_best_decode_b1_tok_s"),
                          ("decode_b1_ratio_vs_hf", "pdserve_decode_b1_tok_s", "hf_decode_b1_tok_s"),
                          ("int8_decode_b1_ratio_vs_bf16", "int8_decode_b1_tok_s", "pdserve_decode_b1_tok_s"),
                          ("gguf_decode_b1_ratio_vs_bf16", "gguf_decode_b1_tok_s", "pdserve_decode_b1_tok_s"),
                          ("kv_int8_decode_long_ratio_vs_bf16", "kv_int8_decode_long_tok_s", "decode_long_tok_s")]:
        assert r[num] > 0 and r[den] > 0, key
        assert r[key] == pytest.approx(r[num] / r[den], abs=0.01), key
    # perplexity of the same text, every variant
    assert r["ppl_tokens"] == 64 and 1 < r["ppl"] < 1000
    assert r["int8_ppl_ratio_vs_bf16"] == pytest.approx(r["int8_ppl"] / r["ppl"], abs=1e-3)
    assert r["gguf_ppl_ratio_vs_bf16"] == pytest.approx(r["gguf_ppl"] / r["ppl"], abs=1e-3)
    assert r["kv_int8_ppl_ratio_vs_bf16"] == pytest.approx(r["kv_int8_ppl"] / r["ppl"], abs=1e-3)
    # the int8 KV cache: more blocks in the same memory, the decode measured after the asked context
    assert r["kv_context_tokens"] == 96 and r["kv_int8_blocks"] > r["kv_blocks"]
    assert r["kv_int8_blocks"] * r["kv_int8_block_bytes"] <= r["kv_blocks"] * r["kv_block_bytes"] + r["kv_int8_block_bytes"]
    assert r["kv_int8_blocks_ratio"] == pytest.approx(r["kv_int8_blocks"] / r["kv_blocks"], abs=0.01)
    if importlib.util.find_spec("llama_cpp") is not None and "llama_cpp_error" in r:
        # a llama-cpp-python build that crashes or fails here: its columns are out, with the reason
        assert r["llama_cpp_error"] and "decode_b1_ratio_vs_llamacpp" not in r
    elif importlib.util.find_spec("llama_cpp") is not None:
        assert r["llamacpp"]["runs"][0]["max_seqs"] == 2 and "llama_cpp_error" not in r
        assert r["decode_b1_ratio_vs_llamacpp"] == pytest.approx(
            r["gguf_decode_b1_tok_s"] / r["llamacpp_decode_b1_tok_s"], abs=0.01)
        assert r["throughput_ratio_vs_llamacpp"] == pytest.approx(r["gguf_tok_s"] / r["llamacpp_tok_s"], abs=0.01)
    else:
        assert "decode_b1_ratio_vs_llamacpp" not in r and "llamacpp" not in r


@pytest.mark.parametrize("flags, names", [(["--dtype", "fp8"], "fp8"), (["--requests", "0"], "--requests"),
                                          (["--hf-batch-sizes", "x"], "--hf-batch-sizes"),
                                          (["--hf-dtypes", "fp16"], "fp16"), (["--sections", "speed"], "speed"),
                                          (["--quantization", "int4"], "int4")])
def test_bad_flags_are_a_clear_error(flags, names):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "engine", *flags],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2  # argparse's usage error, before any model loads
    assert names in proc.stderr and "Traceback" not in proc.stderr
