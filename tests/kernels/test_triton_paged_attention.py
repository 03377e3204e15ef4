"""Paged decode/prefill attention (Triton) against the torch references.

The caches are the engine's strided per-layer views of one
``kv[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` tensor, and
block tables hold shuffled, non-adjacent block ids padded with the null block,
so a kernel that assumes contiguity or block order gives wrong numbers.
"""

import pytest
import torch

pytest.importorskip("triton")

from kernels.paged_attention import (  # noqa: E402
    decode_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache, dtype_name, layer_view  # noqa: E402

HEAD_DIM = 32
# (num_kv_heads, query heads per kv head): MHA and GQA ratios 3 and 8.
GQA = [(2, 1), (2, 3), (1, 8)]
GQA_IDS = ["gqa1", "gqa3", "gqa8"]
# Dots and the online softmax reorder sums; 16-bit runs also round P before P @ V.
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def _paged_kv(num_blocks, block_size, num_kv_heads, dtype, device):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, block_size=block_size,
                       dtype=dtype_name(dtype))
    kv = allocate_kv_cache(spec, num_blocks, device)
    kv.copy_(torch.randn(kv.shape))
    return layer_view(kv, 1)  # layer 1: strides skip over layer 0 and over V/K


def _block_tables(context_lens, block_size, num_blocks, device):
    """Each sequence gets distinct random blocks from 1.. (0 is the null block)."""
    needed = [-(-n // block_size) for n in context_lens]
    width = max(needed) + 1  # one spare column of padding, as a batch's table has
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    assert sum(needed) <= len(ids), "test setup: not enough blocks"
    table = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for s, n in enumerate(needed):
        table[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table.to(device)


def _query(num_tokens, num_heads, dtype, device):
    # A view into a wider qkv-like buffer: q's token stride is not num_heads * head_dim.
    qkv = torch.randn(num_tokens, (num_heads + 4) * HEAD_DIM, device=device).to(dtype)
    return qkv[:, : num_heads * HEAD_DIM].view(num_tokens, num_heads, HEAD_DIM)


DECODE_CASES = {
    # Many short sequences: one split; full, partial and single-token last blocks.
    "short": {"context_lens": [1, 15, 16, 17, 40], "block_size": 16, "splits": False},
    # Few long sequences: contexts cross split boundaries, one split left empty.
    "long": {"context_lens": [517, 300], "block_size": 16, "splits": True},
    "long-bs8": {"context_lens": [700], "block_size": 8, "splits": True},
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("num_kv_heads,group", GQA, ids=GQA_IDS)
def test_decode_matches_reference(case, num_kv_heads, group, dtype, device):
    context_lens, block_size, splits = (DECODE_CASES[case][k] for k in ("context_lens", "block_size", "splits"))
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    k_cache, v_cache = _paged_kv(num_blocks, block_size, num_kv_heads, dtype, device)
    tables = _block_tables(context_lens, block_size, num_blocks, device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = _query(len(context_lens), num_kv_heads * group, dtype, device)
    # The case must exercise the path it is named for (split-K and reduce, or not).
    max_context = tables.shape[1] * block_size
    assert (decode_num_splits(len(context_lens), num_kv_heads, max_context, q.device) > 1) == splits

    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("context_lens", [[0, 5], [0, 600]], ids=["single-split", "split"])
def test_decode_empty_context_gives_zeros(context_lens, device):
    # Padding rows of a batch (context 0) attend to nothing: 0, like the reference.
    k_cache, v_cache = _paged_kv(48, 16, 2, torch.float32, device)
    tables = _block_tables(context_lens, 16, 48, device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = _query(2, 2, torch.float32, device)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


PREFILL_CASES = {
    # Fresh prompts: every query's keys are the prompt itself.
    "no-prefix": {"context_lens": [7, 16, 33], "q_lens": [7, 16, 33], "block_size": 16},
    # Chunks after a cached prefix; 70 queries span two query tiles; 1 query is decode-like.
    "cached-prefix": {"context_lens": [37, 100, 20], "q_lens": [5, 70, 1], "block_size": 16},
    # One step mixing a fresh prompt and a continued chunk, small blocks.
    "mixed-bs8": {"context_lens": [33, 50], "q_lens": [33, 17], "block_size": 8},
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("num_kv_heads,group", GQA, ids=GQA_IDS)
def test_prefill_matches_reference(case, num_kv_heads, group, dtype, device):
    context_lens, q_lens, block_size = (PREFILL_CASES[case][k] for k in ("context_lens", "q_lens", "block_size"))
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    k_cache, v_cache = _paged_kv(num_blocks, block_size, num_kv_heads, dtype, device)
    tables = _block_tables(context_lens, block_size, num_blocks, device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    q = _query(sum(q_lens), num_kv_heads * group, dtype, device)

    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu_seqlens_q, lens, HEAD_DIM**-0.5)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, lens, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_bad_arguments_are_rejected(device):
    k_cache, v_cache = _paged_kv(8, 16, 2, torch.float32, device)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    q = torch.randn(2, 6, HEAD_DIM, device=device)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :16], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :5], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k_cache, v_cache, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="dtypes must match"):
        paged_decode_attention(q.half(), k_cache, v_cache, tables, lens, 1.0)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="context_lens"):
        paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens[:1], 1.0)
