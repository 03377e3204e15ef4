"""Batched LoRA on CPU through the C kernel (lora_cpu.c): one call per projection for the whole
batch, each row reading only its own adapter's rank. Same signature and semantics as
``kernels.lora.lora_apply_ref``, which it calls where the kernel does not apply (no compiler or
AVX-512, activations other than bf16, float stacks other than bf16, layouts it does not take).
Stacks in bf16, int8 or int4 (kernels/lora_quant.py)."""

from __future__ import annotations

from functools import lru_cache

import torch

from kernels import native
from kernels.lora import lora_apply_ref
from kernels.lora_quant import CODES, stack_format

_BF16 = torch.bfloat16


@lru_cache(maxsize=None)
def _available(lib) -> bool:
    return bool(lib.pdserve_lora_available())


def x_quantized() -> bool:
    """Whether this machine's kernel multiplies int8 / int4 stacks by x quantized to int8 in groups
    (kernels/lora_quant.py ``quantize_x_groups``; the VNNI shrinks) rather than by x itself."""
    lib = native.library()
    return lib is not None and _available(lib) and bool(lib.pdserve_lora_quantizes_x())


def lora_apply_cpu(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   bounds: tuple[int, ...], idx: torch.Tensor, ranks: torch.Tensor,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    lib = native.library()
    T, K = x.shape
    fmt = stack_format(a)
    S, R = bt.shape[:2]
    N = y.shape[1]
    nseg = len(bounds) - 1
    per_byte = {"bf16": 1, "int8": 1, "int4": 2}[fmt]  # elements a stored element holds
    if (lib is None or not _available(lib) or {y.dtype, x.dtype} != {_BF16} or stack_format(bt) != fmt
            or (fmt == "bf16" and {a.dtype, bt.dtype} != {_BF16}) or (fmt != "bf16" and scales is None)
            or x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not bt.is_contiguous()
            or a.shape != (S, nseg * R, K // per_byte) or bt.shape != (S, R, N // per_byte) or nseg * R > 1024
            or (scales is not None and not all(s.is_contiguous() for s in scales))
            or idx.dtype != torch.int32 or not idx.is_contiguous() or ranks.dtype != torch.int32):
        return lora_apply_ref(y, x, a, bt, bounds, idx, scales=scales)
    if T == 0:
        return
    bounds_t = _bounds(tuple(bounds))
    sa, sb = (None, None) if scales is None else (scales[0].data_ptr(), scales[1].data_ptr())
    rc = lib.pdserve_lora(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), T, K, N, a.data_ptr(), bt.data_ptr(),
                          R, nseg, bounds_t.data_ptr(), idx.data_ptr(), ranks.data_ptr(), CODES[fmt], sa, sb)
    if rc != 0:
        raise ValueError(f"the LoRA kernel refused a {fmt} stack (K {K}, bounds {bounds}: error {rc})")


@lru_cache(maxsize=64)
def _bounds(bounds: tuple[int, ...]) -> torch.Tensor:  # a handful of distinct tuples per model
    return torch.tensor(bounds, dtype=torch.int32)
