"""llama.cpp's bench columns run in child processes: a llama-cpp-python build that crashes or
fails costs its columns with the reason, never the bench run (one compiled with AMX kernels
segfaulted in llama_decode on a Xeon with AMX, and took the whole run down before)."""

from __future__ import annotations

import argparse
import ctypes

from services.engine.bench import _ratios, llama_cpp_section
from services.engine.bench_llamacpp import isolated


def test_a_crash_in_the_child_is_a_reason_not_a_crash():
    value, why = isolated(ctypes.string_at, 0)  # reads address 0: SIGSEGV in the child
    assert value is None and "process died" in why


def test_an_exception_in_the_child_is_its_message():
    assert isolated(int, "seven") == (None, "ValueError: invalid literal for int() with base 10: 'seven'")
    assert isolated(int, "7") == (7, None)


def test_a_failing_llama_cpp_leaves_its_columns_out_with_the_reason():
    # a file llama.cpp cannot load (or no llama-cpp-python at all): either way no figures, a reason
    args = argparse.Namespace(decode_tokens=4, llamacpp_seqs=[2], max_num_batched_tokens=64)
    section = llama_cpp_section("/nonexistent/model.gguf", [([1, 2, 3], 2)], [1, 2, 3], args, {"decode", "throughput"})
    assert section["error"] and "decode_b1_tok_s" not in section and not section["runs"]
    result = {"dtype": "bfloat16", "pdserve_decode_b1_tok_s": 100.0, "gguf_decode_b1_tok_s": 120.0,
              "llamacpp": section}
    _ratios(result)
    assert result["llama_cpp_error"] == section["error"]
    assert "decode_b1_ratio_vs_llamacpp" not in result and "llamacpp_decode_b1_tok_s" not in result
