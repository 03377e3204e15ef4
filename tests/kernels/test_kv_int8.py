"""The int8 KV cache: its rows (kernels/kv_int8.py), the C write, and the C attention kernels
reading it directly, against the references that dequantize first."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_isa
from kernels.fused_cpu import write_kv_cpu
from kernels.kv_int8 import dequantize_rows, quantize_rows
from kernels.kv_write import write_kv_ref
from kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from kernels.paged_attention_cpu import paged_decode_attention_cpu, paged_prefill_attention_cpu
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache, layer_view
from tests.kernels.test_cpu_paged_attention import ragged_block_tables


def test_rows_are_the_values_then_their_scale_and_round_trip_within_half_a_step():
    x = torch.randn(5, 3, 64)
    x[2, 1] = 0  # an all-zero row
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scale[0, 0], x[0, 0].abs().max() / 127)
    assert scale[2, 1] == 1 and torch.equal(rows[2, 1, :64], torch.zeros(64, dtype=torch.int8))
    err = (dequantize_rows(rows) - x).abs()
    assert (err <= scale[..., None] / 2 + 1e-7).all()


def test_capacity_is_1_88x_bf16_for_head_dim_64():
    int8, bf16 = KVCacheSpec(30, 3, 64, 16, "int8"), KVCacheSpec(30, 3, 64, 16, "bfloat16")
    assert int8.block_bytes == 30 * 2 * 16 * 3 * 68 and bf16.block_bytes / int8.block_bytes == pytest.approx(128 / 68)
    budget = 1 << 30
    assert int8.num_blocks_for_budget(budget) >= 1.88 * bf16.num_blocks_for_budget(budget)


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_c_write_stores_the_reference_bytes(source):
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(2, 3, 64, 16, "int8")
    a, b = allocate_kv_cache(spec, 40), allocate_kv_cache(spec, 40)
    kv = torch.randn(25, 2, 3, 64, generator=gen).to(source)
    k, v = kv[:, 0], kv[:, 1]  # strided like the model's slices
    slots = (torch.randperm(39 * 16, generator=gen)[:25] + 16).long()
    write_kv_cpu(k.contiguous(), v.contiguous(), *layer_view(a, 1), slots)
    write_kv_ref(k, v, *layer_view(b, 1), slots)
    assert torch.equal(a, b) and a.abs().sum() > 0


@pytest.fixture(params=cpu_isa.available())
def level(request):
    previous = cpu_isa.force(request.param)
    yield request.param
    cpu_isa.force(previous)


def _int8_cache(gen, heads_kv=3, head_dim=64, block_size=16, blocks=120):
    kv = allocate_kv_cache(KVCacheSpec(2, heads_kv, head_dim, block_size, "int8"), blocks)
    k_cache, v_cache = layer_view(kv, 1)
    k_cache.copy_(quantize_rows(torch.randn(k_cache.shape[:-1] + (head_dim,), generator=gen)))
    v_cache.copy_(quantize_rows(torch.randn(v_cache.shape[:-1] + (head_dim,), generator=gen)))
    return k_cache, v_cache


@pytest.mark.parametrize("heads", [9, 3])
def test_decode_reads_int8_directly(level, heads):
    gen = torch.Generator().manual_seed(heads)
    k_cache, v_cache = _int8_cache(gen)
    # one tile (256 positions) and more, block boundaries, a single token
    lens = torch.tensor([1, 15, 16, 17, 100, 256, 300, 600], dtype=torch.int32)
    tables = ragged_block_tables(lens, 16, 120, gen)
    q = torch.randn(len(lens), heads, 64, generator=gen).to(torch.bfloat16)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1e-2)


def test_prefill_reads_int8_directly(level):
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _int8_cache(gen)
    ctx = torch.tensor([1, 15, 40, 300], dtype=torch.int32)
    q_lens = [1, 15, 7, 50]  # whole prompts and chunks after a cached prefix
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    tables = ragged_block_tables(ctx, 16, 120, gen)
    q = torch.randn(int(cu[-1]), 9, 64, generator=gen).to(torch.bfloat16)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, ctx, 0.125)
    got = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, cu, ctx, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1e-2)


def test_int8_attention_is_close_to_attention_over_the_unquantized_values():
    # what quantizing the cache costs: the same attention over fp32 K/V differs by ~1% at most
    gen = torch.Generator().manual_seed(9)
    spec32 = KVCacheSpec(1, 3, 64, 16, "float32")
    kv32 = allocate_kv_cache(spec32, 40)
    kv32.copy_(torch.randn(kv32.shape, generator=gen))
    k32, v32 = layer_view(kv32, 0)
    k8, v8 = quantize_rows(k32), quantize_rows(v32)
    lens = torch.tensor([300, 33], dtype=torch.int32)
    tables = ragged_block_tables(lens, 16, 40, gen)
    q = torch.randn(2, 9, 64, generator=gen)
    exact = paged_decode_attention_ref(q, k32, v32, tables, lens, 0.125)
    approx = paged_decode_attention_ref(q, k8, v8, tables, lens, 0.125)
    assert (approx - exact).norm() / exact.norm() < 0.02
