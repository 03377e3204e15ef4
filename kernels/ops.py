"""The set of fused ops the model calls, and which implementation backs them.

The model holds one ``Ops`` and never imports a kernel directly, so the torch
references (CPU) and Triton kernels (CUDA) are interchangeable per engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels.activation import silu_and_mul_ref
from kernels.kv_write import write_kv_ref
from kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from kernels.rmsnorm import rms_norm_ref
from kernels.rotary import rotary_ref


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    write_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable


TORCH_OPS = Ops(
    name="torch",
    rms_norm=rms_norm_ref,
    rotary=rotary_ref,
    silu_and_mul=silu_and_mul_ref,
    write_kv=write_kv_ref,
    decode_attention=paged_decode_attention_ref,
    prefill_attention=paged_prefill_attention_ref,
)


def select_ops(device: str, backend: str = "auto") -> Ops:
    """``auto``: Triton on CUDA, torch references elsewhere."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; expected auto, torch or triton")
    if backend == "torch" or (backend == "auto" and not str(device).startswith("cuda")):
        return TORCH_OPS
    raise ValueError("the triton kernel backend is not built yet; use --kernels torch")
