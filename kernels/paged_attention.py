"""Paged attention over the block-table KV cache: torch references.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[len(block_table) * block_size, H, D] -> first ``length`` tokens."""
    blocks = cache[block_table]  # [nb, bs, H, D] copy
    return blocks.reshape(-1, *cache.shape[2:])[:length]


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
    k = k_cache[block_tables].reshape(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables].reshape(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
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


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for s in range(len(lens)):
        q_start, q_end, ctx = starts[s], starts[s + 1], lens[s]
        q_len = q_end - q_start
        num_blocks = -(-ctx // k_cache.shape[1])
        k = _gather(k_cache, block_tables[s, :num_blocks], ctx).transpose(0, 1)  # [Hkv, ctx, D]
        v = _gather(v_cache, block_tables[s, :num_blocks], ctx).transpose(0, 1)
        qs = q[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        if q_len == ctx:
            mask, causal = None, True
        else:
            # query i (absolute position ctx - q_len + i) sees keys j <= that position
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos, False
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[q_start:q_end] = o.transpose(0, 1)
    return out
