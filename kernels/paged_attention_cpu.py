"""Paged decode attention on CPU through the C kernel in paged_attention_cpu.c.

Same signature and semantics as ``paged_decode_attention_ref``; where the kernel
cannot serve a call (no compiler, fp16, shapes past its fixed limits) it
falls back to the reference, so callers never need to know.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.paged_attention import paged_decode_attention_ref

_FNS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}


def _supported(q, k_cache, v_cache, block_tables, context_lens) -> bool:
    lib = native.library()
    if lib is None or q.dtype not in _FNS or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    if q.device.type != "cpu" or q.dim() != 3 or k_cache.dim() != 4:
        return False
    heads, kv_heads, head_dim, block_size = q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    return (heads % kv_heads == 0 and group <= lib.pdserve_limits(0) and head_dim <= lib.pdserve_limits(1)
            and block_size <= lib.pdserve_limits(2) and q.stride(2) == 1 and k_cache.stride(3) == 1
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
    fn = getattr(native.library(), _FNS[q.dtype])
    fn(q.data_ptr(), q.stride(0), q.stride(1),
       k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
       v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
       block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
       out.data_ptr(), out.stride(0), out.stride(1),
       num_seqs, heads, k_cache.shape[2], head_dim, k_cache.shape[1], float(scale))
    return out
