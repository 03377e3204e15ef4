"""``pdserve bench gpu`` off the GPU: what can be checked without one.

The benchmark's numbers only mean something on a GPU (run ``pdserve bench gpu``
there). Here: it refuses cleanly without CUDA; its bandwidth floor counts the
right bytes; its SDPA baseline attends to exactly the tokens the paged kernel
does; and its decode and mixed sections run end to end through a real engine
(on CPU, on dummy:tiny: a smoke test of the code, not a measurement).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kernels.ops import TORCH_OPS
from kernels.paged_attention import paged_decode_attention_ref
from services.engine import gpu_bench
from services.engine.model import LlamaForCausalLM
from services.engine.model_config import preset_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench")
    gpu_bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["gpu", *argv])


def test_without_cuda_it_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _parse("--json")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        args.func(args)


def test_bad_flags_are_rejected(capsys):
    for argv in (["--batches", "1,x"], ["--contexts", "0"], ["--sections", "decode,latency"]):
        with pytest.raises(SystemExit):
            _parse(*argv)
    assert "sections are decode, attention, mixed" in capsys.readouterr().err


def _meta_model(preset: str) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(preset_config(preset), TORCH_OPS, max_positions=16).to(torch.bfloat16)


def test_floor_reads_every_weight_of_llama_3_2_1b_once():
    model = _meta_model("llama-3.2-1b")
    # Llama 3.2 1B has 1,235,814,400 parameters; tied, so the embedding table is read as the lm_head.
    assert gpu_bench.weight_bytes_read(model, 1) == gpu_bench.weight_bytes_read(model, 256) == 2 * 1_235_814_400


def test_floor_reads_only_the_gathered_rows_of_an_untied_embedding():
    model = _meta_model("llama-3.1-8b")
    row = 4096 * 2
    assert gpu_bench.weight_bytes_read(model, 9) - gpu_bench.weight_bytes_read(model, 8) == row
    everything = sum(p.numel() * 2 for p in model.parameters())
    assert gpu_bench.weight_bytes_read(model, 1) == everything - (128256 - 1) * row


def test_sdpa_baseline_attends_to_the_paged_tokens():
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, head_dim, seqs, context = 40, 4, 2, 6, 8, 3, 13
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    table = (torch.randperm(num_blocks - 1)[: seqs * 4] + 1).view(seqs, 4).to(torch.int32)
    q = torch.randn(seqs, heads, head_dim)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, torch.full((seqs,), context, dtype=torch.int32), 0.3)
    k = gpu_bench.contiguous_kv(k_cache, table, context)
    v = gpu_bench.contiguous_kv(v_cache, table, context)
    assert k.shape == (seqs, kv_heads, context, head_dim) and k.is_contiguous()
    out = gpu_bench.sdpa_decode(q, k, v, 0.3)
    torch.testing.assert_close(out.reshape(seqs, heads, head_dim), ref)


def test_decode_and_mixed_sections_run_end_to_end_on_cpu():
    args = _parse("--model", "dummy:tiny", "--dtype", "fp32", "--batches", "1,3", "--contexts", "40,70",
                  "--decode-steps", "3", "--requests", "2", "--warmup-requests", "1", "--hf-batch-size", "2",
                  "--max-num-seqs", "8", "--kv-cache-gb", "0.01", "--sections", "decode,mixed", "--json")
    result = json.loads(json.dumps(gpu_bench.collect(args, "cpu")))
    assert [(r["batch"], r["context"]) for r in result["decode"]] == [(1, 40), (3, 40), (1, 70), (3, 70)]
    for r in result["decode"]:
        assert 0 < r["floor_ms"] and 0 < r["graph_ms"] and 0 < r["eager_ms"]
        assert r["mbu"] == pytest.approx(r["floor_ms"] / r["graph_ms"])
    by_shape = {(r["batch"], r["context"]): r["bytes_per_step"] for r in result["decode"]}
    assert by_shape[(3, 70)] > by_shape[(3, 40)] > by_shape[(1, 40)], "more sequences and longer contexts read more KV"
    assert result["mbu_b1"] == min(r["mbu"] for r in result["decode"] if r["batch"] == 1)
    mixed = result["mixed"]
    assert mixed["requests"] == 2 and mixed["pdserve_tok_s"] > 0 and mixed["hf_tok_s"] > 0
    assert result["throughput_ratio_vs_hf"] == pytest.approx(mixed["pdserve_tok_s"] / mixed["hf_tok_s"])
    assert "attn_bw_frac_4k" not in result and "attention" not in result
    table = gpu_bench.render(result)
    assert "Decode step" in table and "Mixed workload" in table and "throughput_ratio_vs_hf" in table


def test_attention_section_needs_cuda():
    args = _parse("--model", "dummy:tiny", "--sections", "attention")
    with pytest.raises(ValueError, match="needs CUDA"):
        gpu_bench.collect(args, "cpu")
