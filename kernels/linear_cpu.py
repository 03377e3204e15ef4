"""Linear layers with bf16 weights on CPU through the C kernel in linear_cpu.c.

``PackedLinear`` replaces an ``nn.Linear`` whose weight is bf16 on the CPU: the
weight is repacked once into 32-column panels (the layout the kernel streams)
and the original tensor is dropped, so the model holds one copy. The torch
reference is ``F.linear`` on the unpacked weight; where the kernel cannot run
(not built, no AVX-512, an input dtype it does not take) ``PackedLinear`` calls
the reference, so callers never need to know.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native

PANEL = 32  # output columns per packed panel; must match linear_cpu.c


def kernel_available() -> bool:
    lim = native.limits()
    return lim is not None and lim.vector


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 32), K, 32]``: ``packed[p, k, j] = weight[32 p + j, k]``, zero past N."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:out_features].contiguous()


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` (bf16) packed for ``linear_cpu.c``. ``out_dtype``
    defaults to ``x``'s dtype; fp32 output skips the rounding to bf16 (used for logits)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedLinear takes a 2-D bf16 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_weight(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def unpacked_weight(self) -> torch.Tensor:
        return unpack_weight(self.packed, self.out_features)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        lib = native.library()
        if (lib is None or x.dtype not in (torch.bfloat16, torch.float32) or out_dtype not in (torch.bfloat16, torch.float32)
                or x.device.type != "cpu" or x.shape[-1] != self.in_features):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return linear_ref(x, self.unpacked_weight().to(x.dtype), bias).to(out_dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty((m, self.out_features), dtype=out_dtype)
        if m:
            rc = lib.pdserve_linear_bf16w(
                x2.data_ptr(), int(x2.dtype == torch.bfloat16), x2.stride(0), self.packed.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(),
                y.data_ptr(), int(out_dtype == torch.bfloat16), y.stride(0), m, self.out_features, self.in_features)
            if rc != 0:
                raise MemoryError("linear_cpu: no memory for the kernel's scratch buffers")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
