"""The int8 KV cache (``--kv-cache-dtype int8``): torch reference of its rows.

Each (token, KV head) row holds ``head_dim`` int8 followed by its fp32 scale (4 bytes), so
a block stays one contiguous run (kvtransfer moves blocks as bytes) and a row is
``head_dim + 4`` bytes instead of ``2 * head_dim`` (bf16): 1.88x the tokens for head_dim 64.
Symmetric per row: ``scale = max |x| / 127`` (1 for an all-zero row), ``q = round(x / scale)``
to nearest even. The C write (``pdserve_write_kv_int8``) and attention kernels
(``*_bf16_i8kv`` in paged_attention_cpu.c) read and write the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` float -> ``[..., D + 4]`` int8 rows (quants, then the scale's bytes)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 127), torch.ones_like(amax))
    q = torch.round(xf / scale).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., D + 4]`` int8 rows -> ``[..., D]`` in ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def write_kv_int8_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = quantize_rows(k)
    v_cache[blocks, offsets] = quantize_rows(v)
