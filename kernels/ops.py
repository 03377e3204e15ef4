"""The set of fused ops the model calls, and which implementation backs them.

The model holds one ``Ops`` and never imports a kernel directly, so the three sets
are interchangeable per engine: the torch references (any device), the C kernels
(CPU) and the Triton kernels (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.fused_cpu import rms_norm_cpu, rotary_cpu, silu_and_mul_cpu, write_kv_cpu
from kernels.kv_write import write_kv, write_kv_ref
from kernels.lora import lora_apply, lora_apply_ref
from kernels.lora_cpu import lora_apply_cpu
from kernels.paged_attention_cpu import paged_decode_attention_cpu, paged_prefill_attention_cpu
from kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from kernels.rmsnorm import rms_norm, rms_norm_ref
from kernels.rotary import rotary, rotary_ref
from kernels.triton_jit import interpreting, triton_available


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    write_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable
    lora: Callable  # batched LoRA, a slot per row (kernels/lora.py)
    # bf16 projections through kernels/linear_cpu (the model packs its weights at load)
    packs_linears: bool = False


TORCH_OPS = Ops(
    name="torch",
    rms_norm=rms_norm_ref,
    rotary=rotary_ref,
    silu_and_mul=silu_and_mul_ref,
    write_kv=write_kv_ref,
    decode_attention=paged_decode_attention_ref,
    prefill_attention=paged_prefill_attention_ref,
    lora=lora_apply_ref,
)

# CPU: the C kernels (kernels/*_cpu.c): decode and prefill attention in place on the paged
# cache, one-pass RMSNorm / rotary / SiLU-and-mul / KV write, and bf16 projections on fp32
# FMAs (packs_linears). Each falls back to its torch path where it does not apply (no
# compiler or AVX-512, a dtype or shape it does not take).
CPU_OPS = Ops(
    name="cpu",
    rms_norm=rms_norm_cpu,
    rotary=rotary_cpu,
    silu_and_mul=silu_and_mul_cpu,
    write_kv=write_kv_cpu,
    decode_attention=paged_decode_attention_cpu,
    prefill_attention=paged_prefill_attention_cpu,
    lora=lora_apply_cpu,
    packs_linears=True,
)

TRITON_OPS = Ops(
    name="triton",
    rms_norm=rms_norm,
    rotary=rotary,
    silu_and_mul=silu_and_mul,
    write_kv=write_kv,
    decode_attention=paged_decode_attention,
    prefill_attention=paged_prefill_attention,
    lora=lora_apply,
)


def select_ops(device: str, backend: str = "auto") -> Ops:
    """``auto``: Triton on CUDA when triton imports (else the references); on CPU the C
    kernels (each falling back to its torch path where it cannot run). ``torch``: the
    pure torch references everywhere.

    Forcing ``triton`` off CUDA is allowed only under ``TRITON_INTERPRET=1``
    (triton's CPU interpreter, for tests; far too slow to serve).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; expected auto, torch or triton")
    on_cuda = str(device).startswith("cuda")
    if backend == "torch":
        return TORCH_OPS
    if backend == "auto":
        if on_cuda:
            return TRITON_OPS if triton_available() else TORCH_OPS
        return CPU_OPS
    if not triton_available():
        raise ValueError("the triton kernel backend needs the 'triton' package; install it or use --kernels torch")
    if not on_cuda and not interpreting():
        raise ValueError(
            f"the triton kernel backend needs a CUDA device, got {device!r}; use --kernels torch "
            "(or set TRITON_INTERPRET=1 to run the kernels in triton's CPU interpreter, for tests)"
        )
    return TRITON_OPS
