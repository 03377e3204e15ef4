"""Paged attention over the block-table KV cache: torch references and Triton kernels.

Shapes (T = tokens in the step, S = sequences, M = max blocks per sequence)::

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]  (strided
                       views from services.engine.kv_cache.layer_view)
    block_tables     : int32 [S, M], padded with block 0 (the null block)
    context_lens     : int32 [S], tokens of the sequence with KV in the cache,
                       *including* the ones written this step

Decode: one query per sequence, attending to all ``context_lens[s]`` tokens.
Prefill: ``q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s]`` queries per sequence,
the last ``q_len`` of its ``context_lens[s]`` tokens; query i sits at position
``context_lens[s] - q_len + i`` and sees keys at positions <= its own (causal).

The references gather the needed blocks into a contiguous tensor and call
``scaled_dot_product_attention``; on CPU that is the engine's fast path.

The Triton kernels read K/V in place through the block table, one tile of
``BLOCK_N`` token positions at a time. Position ``p`` of sequence ``s`` lives at::

    block  = block_tables[s, p // block_size]     (int64 before any stride math)
    k_addr = k_cache + block * stride_block + (p % block_size) * stride_offset
           + kv_head * stride_head + d * stride_dim

so any block size, any block order and any cache strides work. Both kernels
run an online softmax in fp32 (log2 domain, ``exp2``); the two dots take the
cache dtype as operands with fp32 accumulation (products of 16-bit floats are
exact in fp32, so only ``P`` is rounded before ``P @ V``), and fp32 inputs use
IEEE dots, not TF32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_ndim, check_same_dtype, check_shape
from kernels.triton_jit import check_launchable, lazy_jit, next_pow2, tl


def _rows(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as ``dtype`` values: an int8 cache's rows (int8 + their scale,
    kernels/kv_int8.py) dequantized, others as they are."""
    if blocks.dtype != torch.int8:
        return blocks
    from kernels.kv_int8 import dequantize_rows

    return dequantize_rows(blocks, dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(block_table) * block_size, H, D] -> first ``length`` tokens."""
    blocks = _rows(cache[block_table], dtype)  # [nb, bs, H, D] copy
    return blocks.reshape(-1, *blocks.shape[2:])[:length]


def paged_decode_attention_ref(
    q: torch.Tensor,  # [S, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_len = block_tables.shape[1] * k_cache.shape[1]
    # [S, M, bs, Hkv, D] -> [S, Hkv, M*bs, D]
    k = _rows(k_cache[block_tables], q.dtype).reshape(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = _rows(v_cache[block_tables], q.dtype).reshape(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(torch.long)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [S, H, 1, D]
        k,
        v,
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(2)


def prefill_by_sequence(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, attend) -> torch.Tensor:
    """The loop every torch prefill path shares: per sequence, gather its context's K/V from
    the blocks and let ``attend(qs [H, q_len, D], k, v [Hkv, ctx, D], ctx)`` return its output
    ``[H, q_len, D]`` (the queries are the last ``q_len`` of the ``ctx`` tokens)."""
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for s in range(len(lens)):
        q_start, q_end, ctx = starts[s], starts[s + 1], lens[s]
        num_blocks = -(-ctx // k_cache.shape[1])
        k = _gather(k_cache, block_tables[s, :num_blocks], ctx, q.dtype).transpose(0, 1)  # [Hkv, ctx, D]
        v = _gather(v_cache, block_tables[s, :num_blocks], ctx, q.dtype).transpose(0, 1)
        out[q_start:q_end] = attend(q[q_start:q_end].transpose(0, 1), k, v, ctx).transpose(0, 1)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    gqa = q.shape[1] != k_cache.shape[2]

    def attend(qs, k, v, ctx):
        q_len = qs.shape[1]
        if q_len == ctx:
            mask, causal = None, True
        else:
            # query i (absolute position ctx - q_len + i) sees keys j <= that position
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos, False
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)

    return prefill_by_sequence(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, attend)


_LOG2E = 1.4426950408889634

# Decode splits each sequence's context into chunks of at least this many
# tokens: shorter chunks cost more in partial results and the reduce than the
# parallelism they add.
_MIN_SPLIT_TOKENS = 128


@lazy_jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_heads, head_dim, split_tokens, num_splits,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bts, stride_btm,
    stride_os, stride_oh, stride_od,
    GROUP: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    # One program per (sequence, kv head, split): the GROUP query heads sharing
    # the kv head are the rows of one dot, so each K/V tile is read once for all
    # of them (padded to BLOCK_G >= 16 rows, the smallest tensor-core tile).
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, ctx)  # empty when this split lies past ctx

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < head_dim
    q_mask = mask_g[:, None] & mask_d[None, :]
    q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bts
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = pos < end
        block = tl.load(table + (pos // CACHE_BLOCK_SIZE) * stride_btm, mask=valid, other=0).to(tl.int64)
        in_block = pos % CACHE_BLOCK_SIZE
        kv_mask = valid[:, None] & mask_d[None, :]
        k_off = block[:, None] * stride_kb + in_block[:, None] * stride_ko + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        # The first tile has a valid column, so m_new is finite from here on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = block[:, None] * stride_vb + in_block[:, None] * stride_vo + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        # context_len 0 attends to nothing: 0, as the reference's all-masked SDPA gives.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials are contiguous fp32 [S, H, num_splits, (head_dim)], unnormalised.
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=q_mask)
        tl.store(part_max_ptr + part, m_i, mask=mask_g)
        tl.store(part_sum_ptr + part, l_i, mask=mask_g)


@lazy_jit
def _decode_reduce_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr, out_ptr,
    num_heads, head_dim, split_tokens, num_splits,
    stride_os, stride_oh, stride_od,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, query head) merges the splits that held tokens:
    #   out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j,   M = max_j m_j
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    active = tl.cdiv(ctx, split_tokens)
    offs_j = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_j = offs_j < active
    mask_d = offs_d < head_dim
    part = (seq * num_heads + head) * num_splits + offs_j
    m = tl.load(part_max_ptr + part, mask=mask_j, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=mask_j, other=0.0)
    acc_ptrs = part_acc_ptr + part[:, None] * head_dim + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=mask_j[:, None] & mask_d[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no split active: avoid -inf - -inf
    w = tl.exp2(m - m_max)  # 0 for inactive splits (m = -inf)
    total = tl.sum(sums * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@lazy_jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    scale_log2, num_seqs, head_dim,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bts, stride_btm,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grid axis 0 numbers query tiles of all sequences without knowing their
    # lengths on the host: sequence s owns the tile ids starting at
    #     first(s) = cu_seqlens_q[s] // BLOCK_M + s,
    # which leaves it at least cdiv(q_len_s, BLOCK_M) ids, so T // BLOCK_M + S
    # ids cover every sequence; spare ids exit at once. first() is increasing,
    # so a program finds its sequence by binary search.
    tile_id = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    lo = 0
    hi = num_seqs  # invariant: first(lo) <= tile_id < first(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= tile_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m_start = (tile_id - (q_start // BLOCK_M + seq)) * BLOCK_M
    if m_start >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    q_rows = (q_start + offs_m).to(tl.int64)
    q_mask = mask_m[:, None] & mask_d[None, :]
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    # Absolute positions. Rows past q_len get positions >= ctx: they see every
    # key, so they stay finite (and are never stored); real rows see key 0.
    q_pos = ctx - q_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bts
    # Causal: no row of this tile sees past its last query's position.
    kv_end = tl.minimum(ctx, ctx - q_len + m_start + BLOCK_M)
    for tile in range(0, kv_end, BLOCK_N):
        pos = tile + offs_n
        valid = pos < kv_end
        block = tl.load(table + (pos // CACHE_BLOCK_SIZE) * stride_btm, mask=valid, other=0).to(tl.int64)
        in_block = pos % CACHE_BLOCK_SIZE
        kv_mask = valid[:, None] & mask_d[None, :]
        k_off = block[:, None] * stride_kb + in_block[:, None] * stride_ko + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = block[:, None] * stride_vb + in_block[:, None] * stride_vo + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_paged_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_seqs: int,
) -> None:
    check_ndim("q", q, 3, "[tokens, num_heads, head_dim]")
    check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_shape("v_cache", v_cache, k_cache.shape, "(same as k_cache)")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} must match q's {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    check_shape("context_lens", context_lens, (num_seqs,), "[num_seqs]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_dtype("context_lens", context_lens, INDEX_DTYPES)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype: torch.dtype) -> str | None:
    # TF32 would round fp32 operands to 10 mantissa bits. 16-bit operands keep
    # triton's default (the setting only concerns fp32 dots).
    return "ieee" if dtype == torch.float32 else None


def _kv_tile(head_dim: int, dtype: torch.dtype) -> int:
    # Keeps a K or V tile row at <= 256 bytes (64 x 128 16-bit elements): the
    # pipelined prefill then needs <= ~80 KiB of shared memory, within every
    # GPU since sm_80, and the tiles fit registers with 4 warps.
    return 64 if head_dim * dtype.itemsize <= 256 else 32


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter has no SMs; a small pretend GPU makes few-sequence calls
    # (the tests) split their contexts as they would on a real one.
    return 4


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many chunks decode splits each context into (split-K).

    One program per (sequence, kv head) leaves most SMs idle for a few long
    sequences, so the context is split until there are about two programs per
    SM, but never into chunks shorter than ``_MIN_SPLIT_TOKENS``.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = _cdiv(2 * _multiprocessor_count(device), programs)
    return max(1, min(wanted, max_context // _MIN_SPLIT_TOKENS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton ``paged_decode_attention_ref``.

    Preconditions not checked (they would need the values on the host):
    ``context_lens[s] <= block_tables.shape[1] * block_size`` and every block
    id in use is below ``num_blocks``.
    """
    check_ndim("q", q, 3, "[num_seqs, num_heads, head_dim]")
    num_seqs = q.shape[0]
    _check_paged_args(q, k_cache, v_cache, block_tables, context_lens, num_seqs)
    check_launchable(q, k_cache, v_cache, block_tables, context_lens)
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out

    block_n = _kv_tile(head_dim, q.dtype)
    # The padded block table bounds every context without reading context_lens.
    max_context = block_tables.shape[1] * block_size
    num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context, q.device)
    # Splits are whole tiles so that only a context's last tile is ragged.
    split_tokens = max(1, _cdiv(_cdiv(max_context, num_splits), block_n)) * block_n
    num_splits = max(1, _cdiv(max_context, split_tokens))
    single = num_splits == 1
    if single:
        part_acc = part_max = part_sum = out  # unused: the kernel writes out directly
    else:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)

    block_d = max(16, next_pow2(head_dim))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        float(scale) * _LOG2E,
        num_heads,
        head_dim,
        split_tokens,
        num_splits,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=num_heads // num_kv_heads,
        CACHE_BLOCK_SIZE=block_size,
        BLOCK_G=max(16, next_pow2(num_heads // num_kv_heads)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype),
        SINGLE_SPLIT=single,
        num_warps=4,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc,
            part_max,
            part_sum,
            context_lens,
            out,
            num_heads,
            head_dim,
            split_tokens,
            num_splits,
            *out.stride(),
            BLOCK_SPLITS=next_pow2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton ``paged_prefill_attention_ref``.

    Preconditions not checked (they would need the values on the host):
    ``cu_seqlens_q`` is non-decreasing from 0 to ``T``, ``q_len <= context_lens[s]
    <= block_tables.shape[1] * block_size``, and block ids are below ``num_blocks``.
    """
    check_ndim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must hold num_seqs + 1 >= 1 offsets")
    _check_paged_args(q, k_cache, v_cache, block_tables, context_lens, num_seqs)
    check_dtype("cu_seqlens_q", cu_seqlens_q, INDEX_DTYPES)
    check_launchable(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    block_m = block_n = _kv_tile(head_dim, q.dtype)
    _prefill_kernel[(num_tokens // block_m + num_seqs, num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        float(scale) * _LOG2E,
        num_seqs,
        head_dim,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=num_heads // num_kv_heads,
        CACHE_BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4,
    )
    return out
