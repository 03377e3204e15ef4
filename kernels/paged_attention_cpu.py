"""Paged attention on CPU (caches in the queries' dtype, or int8 rows: kernels/kv_int8.py).

Decode: the C kernel in paged_attention_cpu.c, with the signature and semantics of
``paged_decode_attention_ref``; where it cannot serve a call (no compiler, fp16,
shapes past its fixed limits) it falls back to the reference, so callers never
need to know.

Prefill: the C kernel in paged_attention_cpu.c (reads the paged cache in place; every
softmax quantity elementwise across 32 query rows); where it cannot serve a call,
``paged_prefill_attention_ref``'s gather, then torch's flash attention in fp32 with a
bottom-right causal bias (3-4x faster than the reference's explicit boolean mask, and
fp32 flash runs about twice as fast as bf16 flash).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels import native
from kernels.paged_attention import paged_decode_attention_ref, prefill_by_sequence

_FNS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}


def _kv_fits(q, k_cache, v_cache, lim) -> bool:
    """The caches hold q's dtype, or int8 rows (head_dim + scale, kernels/kv_int8.py) the
    AVX-512 kernels read for bf16 queries with head_dim % 32 == 0."""
    if k_cache.dtype == torch.int8:
        return (v_cache.dtype == torch.int8 and q.dtype == torch.bfloat16 and lim.vector and q.shape[-1] % 32 == 0
                and k_cache.shape[-1] == q.shape[-1] + 4 and v_cache.shape[-1] == q.shape[-1] + 4)
    return k_cache.dtype == q.dtype and v_cache.dtype == q.dtype


def _supported(q, k_cache, v_cache, block_tables, context_lens) -> bool:
    lim = native.limits()
    if lim is None or q.dtype not in _FNS or not _kv_fits(q, k_cache, v_cache, lim):
        return False
    if q.device.type != "cpu" or q.dim() != 3 or k_cache.dim() != 4:
        return False
    heads, kv_heads, head_dim, block_size = q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    return (heads % kv_heads == 0 and group <= lim.max_group and head_dim <= lim.max_head_dim
            and block_size <= lim.max_block_size and q.stride(2) == 1 and k_cache.stride(3) == 1
            and v_cache.stride(3) == 1 and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
            and context_lens.dtype == torch.int32 and context_lens.is_contiguous())


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [S, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if not _supported(q, k_cache, v_cache, block_tables, context_lens):
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    num_seqs, heads, head_dim = q.shape
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError("block_tables and context_lens need one row per sequence")
    out = torch.empty((num_seqs, heads, head_dim), dtype=q.dtype)
    if num_seqs == 0:
        return out
    int8 = k_cache.dtype == torch.int8
    fn = getattr(native.library(), "paged_decode_attention_bf16_i8kv" if int8 else _FNS[q.dtype])
    rc = fn(q.data_ptr(), q.stride(0), q.stride(1),
       k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
       v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
       block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
       out.data_ptr(), out.stride(0), out.stride(1),
       num_seqs, heads, k_cache.shape[2], head_dim, k_cache.shape[1], float(scale))
    if int8 and rc != 0:  # not compiled in at this level
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    return out


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``paged_prefill_attention_ref``: sequence s's ``q_len`` queries are
    the last ``q_len`` of its ``context_lens[s]`` tokens, each seeing keys up to itself.
    The C kernel where it applies (AVX-512, D % 16 == 0, up to 32 query heads per KV head),
    else per sequence: gather, then torch's fp32 flash attention."""
    if _prefill_supported(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens):
        num_seqs = context_lens.shape[0]
        out = torch.empty_like(q)
        int8 = k_cache.dtype == torch.int8
        fn = getattr(native.library(), "paged_prefill_attention_bf16_i8kv" if int8 else _PREFILL_FNS[q.dtype])
        rc = fn(q.data_ptr(), q.stride(0), q.stride(1),
                k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                block_tables.data_ptr(), block_tables.stride(0), cu_seqlens_q.data_ptr(), context_lens.data_ptr(),
                out.data_ptr(), out.stride(0), out.stride(1),
                num_seqs, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], float(scale))
        if rc == 0:
            return out
        if rc == -1:
            raise MemoryError("paged prefill attention: no memory for the work list")
    gqa = q.shape[1] != k_cache.shape[2]

    def attend(qs, k, v, ctx):  # k, v: gathered (an int8 cache's rows dequantized)
        o = F.scaled_dot_product_attention(qs.float()[None], k.float()[None], v.float()[None],
                                           attn_mask=causal_lower_right(qs.shape[1], ctx), scale=scale, enable_gqa=gqa)
        return o[0]

    return prefill_by_sequence(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, attend)


_PREFILL_FNS = {torch.float32: "paged_prefill_attention_f32", torch.bfloat16: "paged_prefill_attention_bf16"}
PREFILL_MAX_GROUP = 32  # query heads per KV head; PF_ROWS in paged_attention_cpu.c


def _prefill_supported(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens) -> bool:
    lim = native.limits()
    if lim is None or not lim.vector:
        return False
    if q.dtype not in _PREFILL_FNS or not _kv_fits(q, k_cache, v_cache, lim) or q.device.type != "cpu":
        return False
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    return (q.dim() == 3 and k_cache.dim() == 4 and heads % kv_heads == 0 and heads // kv_heads <= PREFILL_MAX_GROUP
            and head_dim % 16 == 0 and head_dim <= lim.max_head_dim
            and q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
            and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
            and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
            and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
            and cu_seqlens_q.shape[0] == context_lens.shape[0] + 1)
