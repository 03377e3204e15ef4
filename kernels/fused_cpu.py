"""The model's small ops (RMSNorm, rotary, SiLU-and-mul, KV write) on CPU through the C
kernels in fused_cpu.c: one call per op for the whole batch instead of the several torch
ops and fp32 temporaries of each reference.

Each function has the signature and semantics of its torch reference (and calls it
where the kernel does not apply: no compiler or no AVX-512, dtypes other than bf16,
layouts the kernel does not take), so callers never need to know. ``rotary_cpu``
rotates q and k in place (the model's q and k are fresh slices of the qkv projection).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kernels import native
from kernels.activation import silu_and_mul_ref
from kernels.kv_write import write_kv_ref
from kernels.rmsnorm import rms_norm_ref
from kernels.rotary import rotary_ref

_BF16 = torch.bfloat16


def _lib():
    lib = native.library()
    return lib if lib is not None and _fused_available(lib) else None


@lru_cache(maxsize=None)
def _fused_available(lib) -> bool:  # asked once per library, not on every op
    return bool(lib.pdserve_fused_available())


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as [rows, last] with unit stride in the last dim, without copying; else None."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    lib = _lib()
    rows, res_rows = _rows(x), _rows(residual) if residual is not None else None
    if (lib is None or x.dtype != _BF16 or weight.dtype != _BF16 or not weight.is_contiguous() or rows is None
            or (residual is not None and (residual.dtype != _BF16 or residual.shape != x.shape or res_rows is None))):
        return rms_norm_ref(x, weight, eps, residual)
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=_BF16)
    res_out = torch.empty(x.shape, dtype=_BF16) if residual is not None else None
    m = rows.shape[0]
    if m:
        lib.pdserve_rms_norm_bf16(rows.data_ptr(), rows.stride(0),
                                  res_rows.data_ptr() if res_rows is not None else None,
                                  res_rows.stride(0) if res_rows is not None else 0, weight.data_ptr(),
                                  out.data_ptr(), hidden, res_out.data_ptr() if res_out is not None else None, hidden,
                                  m, hidden, float(eps))
    return out if residual is None else (out, res_out)


def rotary_cpu(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    lib = _lib()
    if (lib is None or q.dtype != _BF16 or k.dtype != _BF16 or q.dim() != 3 or k.dim() != 3
            or q.stride(2) != 1 or k.stride(2) != 1 or q.shape[2] % 2 or q.shape[2] > 512
            or positions.dtype != torch.int64 or not positions.is_contiguous()
            or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1):
        return rotary_ref(q, k, positions, cos_sin_cache)
    num_tokens, _, head_dim = q.shape
    if num_tokens:
        for x in (q, k):
            lib.pdserve_rotary_bf16(x.data_ptr(), x.stride(0), x.stride(1), num_tokens, x.shape[1], head_dim,
                                    positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.stride(0))
    return q, k


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    lib = _lib()
    rows = _rows(x)
    if lib is None or x.dtype != _BF16 or rows is None or x.shape[-1] % 2:
        return silu_and_mul_ref(x)
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=_BF16)
    if rows.shape[0]:
        lib.pdserve_silu_and_mul_bf16(rows.data_ptr(), rows.stride(0), out.data_ptr(), inter, rows.shape[0], inter)
    return out


def write_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    lib = native.library()
    row = k.shape[1] * k.shape[2]

    def packed_rows(t):  # [T, Hkv, D] with each token's row contiguous
        return t.stride(2) == 1 and t.stride(1) == t.shape[2]

    if k_cache.dtype == torch.int8:  # quantized rows (kernels/kv_int8.py)
        if (lib is None or k.dtype not in (_BF16, torch.float32) or v.dtype != k.dtype or k.shape != v.shape
                or not (packed_rows(k) and packed_rows(v)) or k.shape[2] > 512
                or k_cache.shape[3] != k.shape[2] + 4 or k_cache.stride(3) != 1 or k_cache.stride(2) != k_cache.shape[3]
                or k_cache.stride()[:2] != v_cache.stride()[:2]
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
            return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        if k.shape[0]:
            lib.pdserve_write_kv_int8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), int(k.dtype == _BF16),
                                      k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                                      slot_mapping.data_ptr(), k.shape[0], k.shape[1], k.shape[2], k_cache.shape[1])
        return None

    if (lib is None or k.dtype != k_cache.dtype or v.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype
            or not (packed_rows(k) and packed_rows(v) and packed_rows(k_cache[:, 0]) and packed_rows(v_cache[:, 0]))
            or k_cache.stride()[:2] != v_cache.stride()[:2] or k.shape != v.shape
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0]:
        lib.pdserve_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), slot_mapping.data_ptr(),
                             k.shape[0], row, k_cache.shape[1], k.element_size())
