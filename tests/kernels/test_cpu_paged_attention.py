"""The C paged-decode-attention kernel (CPU path) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.paged_attention import paged_decode_attention_ref
from kernels.paged_attention_cpu import paged_decode_attention_cpu
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache, layer_view


def test_the_kernel_builds_here():
    # CI has a C compiler; a silent fallback to the reference would hide a broken build
    assert native.library() is not None


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 8), (32, 4)])
@pytest.mark.parametrize("block_size", [16, 8])
def test_matches_reference_on_ragged_block_tables(dtype, atol, heads, kv_heads, block_size):
    check_against_reference(dtype, atol, heads, kv_heads, block_size, head_dim=64)


# head_dim 128 and 64 take the vector path (multiples of 32), 48 and 40 the portable one;
# 32-token blocks hold two 16-position groups each
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (48, 32), (40, 16), (64, 32)])
def test_matches_reference_for_other_head_dims_and_block_sizes(dtype, atol, head_dim, block_size):
    check_against_reference(dtype, atol, 6, 2, block_size, head_dim)


def ragged_block_tables(lens, block_size, num_blocks, gen):
    """Each sequence's blocks drawn in random order from blocks 1..num_blocks-1, rows padded
    with the null block past their end (and one spare column)."""
    width = max(-(-int(n) // block_size) for n in lens) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens.tolist()):
        nb = -(-n // block_size)
        tables[s, :nb] = order[used : used + nb]
        used += nb
    return tables


def check_against_reference(dtype, atol, heads, kv_heads, block_size, head_dim):
    gen = torch.Generator().manual_seed(heads * 100 + block_size + head_dim)
    spec = KVCacheSpec(3, kv_heads, head_dim, block_size, "float32" if dtype == torch.float32 else "bfloat16")
    kv = allocate_kv_cache(spec, 250)
    kv.copy_(torch.randn(kv.shape, generator=gen).to(dtype))
    k_cache, v_cache = layer_view(kv, 1)  # strided views, as the model passes them
    # 256 positions make one softmax tile: 256, 257 and 600 cross tile boundaries (600 crosses two);
    # ten sequences are enough for the kernel to hand each thread whole sequences
    lens = torch.tensor([1, block_size - 1, block_size, block_size + 1, 100, 33, 150, 256, 257, 600], dtype=torch.int32)
    tables = ragged_block_tables(lens, block_size, 250, gen)
    qkv = torch.randn(len(lens), heads * head_dim * 2, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(len(lens), heads, head_dim)  # non-contiguous rows, like the model's q
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def test_unsupported_dtype_falls_back_to_the_reference():
    spec = KVCacheSpec(1, 2, 16, 16, "float16")
    kv = allocate_kv_cache(spec, 4)
    kv.normal_()
    k_cache, v_cache = layer_view(kv, 0)
    q = torch.randn(2, 4, 16, dtype=torch.float16)
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    torch.testing.assert_close(paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.25),
                               paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25))


# ---- prefill --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2
    (8, 8, 64, 8),     # no GQA, blocks smaller than a 16-key tile
    (32, 4, 128, 16),  # Llama-style GQA, head_dim 128
    (32, 1, 48, 32),   # 32 query heads per KV head: one query per 32-row block; D not a multiple of 32
    (6, 2, 40, 16),    # D % 16 != 0: the gather + SDPA path
])
def test_prefill_matches_reference(dtype, atol, heads, kv_heads, head_dim, block_size):
    from kernels.paged_attention import paged_prefill_attention_ref
    from kernels.paged_attention_cpu import paged_prefill_attention_cpu

    gen = torch.Generator().manual_seed(heads + head_dim + block_size)
    spec = KVCacheSpec(2, kv_heads, head_dim, block_size, "float32" if dtype == torch.float32 else "bfloat16")
    kv = allocate_kv_cache(spec, 160)
    kv.copy_(torch.randn(kv.shape, generator=gen).to(dtype))
    k_cache, v_cache = layer_view(kv, 1)
    # (queries, context): whole prompts, chunks continuing a prefix (queries are the context's
    # last tokens), one-token chunks, lengths around the 16-key tiles and the query blocks
    shape = [(1, 1), (17, 17), (5, 40), (33, 100), (16, 16), (1, 77), (130, 300)]
    q_lens = [a for a, _ in shape]
    lens = torch.tensor([b for _, b in shape], dtype=torch.int32)
    tables = ragged_block_tables(lens, block_size, 160, gen)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    qkv = torch.randn(int(cu[-1]), heads * head_dim * 2, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)  # non-contiguous rows, like the model's q
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.125)
    got = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, cu, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
