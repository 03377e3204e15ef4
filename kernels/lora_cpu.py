"""Batched LoRA on CPU through the C kernel (lora_cpu.c): one call per projection for the whole
batch, each row reading only its own adapter's rank. Same signature and semantics as
``kernels.lora.lora_apply_ref``, which it calls where the kernel does not apply (no compiler or
AVX-512, activations or stacks other than bf16, layouts it does not take)."""

from __future__ import annotations

from functools import lru_cache

import torch

from kernels import native
from kernels.lora import lora_apply_ref

_BF16 = torch.bfloat16


@lru_cache(maxsize=None)
def _available(lib) -> bool:
    return bool(lib.pdserve_lora_available())


def lora_apply_cpu(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   bounds: tuple[int, ...], idx: torch.Tensor, ranks: torch.Tensor) -> None:
    lib = native.library()
    T, K = x.shape
    S, R, N = bt.shape
    nseg = len(bounds) - 1
    if (lib is None or not _available(lib) or {y.dtype, x.dtype, a.dtype, bt.dtype} != {_BF16}
            or x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not bt.is_contiguous()
            or a.shape != (S, nseg * R, K) or y.shape != (T, N) or nseg * R > 1024
            or idx.dtype != torch.int32 or not idx.is_contiguous() or ranks.dtype != torch.int32):
        return lora_apply_ref(y, x, a, bt, bounds, idx)
    if T == 0:
        return
    bounds_t = _bounds(tuple(bounds))
    lib.pdserve_lora_bf16(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), T, K, N, a.data_ptr(),
                          bt.data_ptr(), R, nseg, bounds_t.data_ptr(), idx.data_ptr(), ranks.data_ptr())


@lru_cache(maxsize=64)
def _bounds(bounds: tuple[int, ...]) -> torch.Tensor:  # a handful of distinct tuples per model
    return torch.tensor(bounds, dtype=torch.int32)
