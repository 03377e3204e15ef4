"""Scatter a step's new K/V into their cache slots: torch reference and Triton kernel.

``slot_mapping[t] = block_id * block_size + offset`` for token t; the caches are
``[num_blocks, block_size, num_kv_heads, head_dim]`` views (see
services.engine.kv_cache). Slots are unique within a step.
"""

from __future__ import annotations

import torch

from kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_ndim, check_shape, check_writable
from kernels.triton_jit import check_launchable, lazy_jit, next_pow2, tl


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    if k_cache.dtype == torch.int8:  # rows of int8 + their scale (kernels/kv_int8.py)
        from kernels.kv_int8 import write_kv_int8_ref

        return write_kv_int8_ref(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


@lazy_jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    CACHE_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # int64: block_id * stride_kcb exceeds 2**31 elements on large caches, and
    # the layer-interleaved layout makes stride_kcb num_layers times larger.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (e.g. a CUDA-graph batch padded to a
    # captured size): it has no cache slot, so nothing is written.
    if slot >= 0:
        block = slot // CACHE_BLOCK_SIZE
        offset = slot % CACHE_BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims * stride_kcd
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims * stride_vcd
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton ``write_kv_ref``. Slots must be unique and below
    ``num_blocks * block_size`` (not checked: reading them would synchronise with
    the GPU); a negative slot is skipped."""
    check_ndim("k", k, 3, "[T, Hkv, D]")
    check_shape("v", v, k.shape, "(same as k)")
    check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    check_shape("v_cache", v_cache, k_cache.shape, "(same as k_cache)")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} must match k's {tuple(k.shape[1:])}")
    check_shape("slot_mapping", slot_mapping, (k.shape[0],), "[T]")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_writable("k_cache", k_cache)
    check_writable("v_cache", v_cache)
    check_launchable(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        CACHE_BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )
