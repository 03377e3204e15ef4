"""Rotary position embedding (GPT-NeoX / HF "rotate_half" style): torch reference
and Triton kernel.

``cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq))``, shape
``[max_positions, head_dim]`` in fp32 (services.engine.rope builds it, with the
config's theta and scaling). Returns new q, k; inputs are not modified.
"""

from __future__ import annotations

import torch

from kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_ndim, check_shape
from kernels.triton_jit import check_launchable, lazy_jit, next_pow2, tl


def rotary_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # int64 [T]
    cos_sin_cache: torch.Tensor,  # fp32 [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


@lazy_jit
def _rotary_kernel(
    x_ptr, out_ptr, positions_ptr, cache_ptr,
    num_heads,
    stride_xt, stride_xh, stride_xd,
    stride_ot, stride_oh, stride_od,
    stride_cp, stride_cd,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per (token, group of BLOCK_H heads): cos/sin are loaded once per
    # token and broadcast over the heads.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask_j = j < HALF
    mask = (heads < num_heads)[:, None] & mask_j[None, :]

    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_cp + j * stride_cd, mask=mask_j, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cp + (j + HALF) * stride_cd, mask=mask_j, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]

    x_row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(x_row + j[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (j[None, :] + HALF) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    out_ty = out_ptr.dtype.element_ty
    tl.store(o_row + j[None, :] * stride_od, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(o_row + (j[None, :] + HALF) * stride_od, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_heads == 0:
        return out
    block_half = next_pow2(head_dim // 2)
    # Keep a tile near 2K elements: enough work per program, few registers.
    block_h = min(next_pow2(num_heads), max(1, 2048 // block_half))
    grid = (num_tokens, -(-num_heads // block_h))
    _rotary_kernel[grid](
        x,
        out,
        positions,
        cos_sin_cache,
        num_heads,
        *x.stride(),
        *out.stride(),
        *cos_sin_cache.stride(),
        HALF=head_dim // 2,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
    )
    return out


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rotary_ref``. ``positions`` must lie in ``[0, max_positions)``
    (not checked: reading them would synchronise with the GPU)."""
    check_ndim("q", q, 3, "[T, H, D]")
    check_ndim("k", k, 3, "[T, Hkv, D]")
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate_half, got {head_dim}")
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k must be [T={num_tokens}, Hkv, D={head_dim}], got {tuple(k.shape)}")
    check_shape("positions", positions, (num_tokens,), "[T]")
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_positions, head_dim]")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_positions, {head_dim}] (cat(cos, sin)), got {tuple(cos_sin_cache.shape)}"
        )
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("k", k, FLOAT_DTYPES)
    check_dtype("positions", positions, INDEX_DTYPES)
    check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_launchable(q, k, positions, cos_sin_cache)
    return _rotate(q, positions, cos_sin_cache), _rotate(k, positions, cos_sin_cache)
