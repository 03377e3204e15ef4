"""Scatter a step's new K/V into their cache slots: torch reference.

``slot_mapping[t] = block_id * block_size + offset`` for token t; the caches are
``[num_blocks, block_size, num_kv_heads, head_dim]`` views (see
services.engine.kv_cache). Slots are unique within a step.
"""

from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    block_size = k_cache.shape[1]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)
