"""Linear layers with bf16 or int8 weights on CPU through the C kernels in linear_cpu.c
(and linear_amx.c for many rows on CPUs with AMX).

``PackedLinear`` replaces an ``nn.Linear`` on the CPU: the weight is repacked once into
32-column panels (the layout the kernels stream) and the original tensor is dropped, so the
model holds one copy. Weights are bf16, or int8 with one fp32 scale per output channel
(weight-only quantization: ``y = (x @ Q^T) * scale``; activations stay bf16/fp32). The torch
reference is ``F.linear`` on the unpacked (dequantized) weight; where the kernels cannot run
(not built, an input dtype they do not take) ``PackedLinear`` calls the reference, so callers
never need to know.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native

PANEL = 32  # output columns per packed panel; must match linear_cpu.c
_KINDS = {torch.bfloat16: 0, torch.int8: 1}  # WK_BF16, WK_I8 in linear_pack.h


def kernel_available() -> bool:
    """The AVX-512 projection kernel runs here (below AVX-512, bf16 projections stay on torch)."""
    lim = native.limits()
    return lim is not None and lim.vector


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``scale[n] = max |W[n]| / 127``, ``Q = round(W / scale)``.
    Returns (Q int8 [N, K], scale fp32 [N]); an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


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
    """``y = x @ W^T + b`` with ``W`` packed for ``linear_cpu.c``: bf16, or int8 with a per-row
    ``scale``. ``out_dtype`` defaults to ``x``'s dtype; fp32 output skips the rounding to bf16
    (used for logits)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in _KINDS:
            raise ValueError(f"PackedLinear takes a 2-D bf16 or int8 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        if (weight.dtype == torch.int8) != (scale is not None):
            raise ValueError("an int8 weight needs its per-row scale (and a bf16 weight takes none)")
        if scale is not None and tuple(scale.shape) != (weight.shape[0],):
            raise ValueError(f"scale has shape {tuple(scale.shape)}, expected ({weight.shape[0]},)")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_weight(weight.detach()), persistent=False)
        self.register_buffer("scale", None if scale is None else scale.detach().float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    @classmethod
    def quantized(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
        """int8 weight-only from a float weight (quantize_int8)."""
        q, scale = quantize_int8(weight)
        return cls(q, bias, scale)

    def unpacked_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight the kernel multiplies by (int8: dequantized), in ``dtype``."""
        w = unpack_weight(self.packed, self.out_features)
        return w.to(dtype) if self.scale is None else dequantize_int8(w, self.scale).to(dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        lib = native.library()
        if (lib is None or x.dtype not in (torch.bfloat16, torch.float32) or out_dtype not in (torch.bfloat16, torch.float32)
                or x.device.type != "cpu" or x.shape[-1] != self.in_features):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return linear_ref(x, self.unpacked_weight(x.dtype), bias).to(out_dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty((m, self.out_features), dtype=out_dtype)
        if m:
            rc = lib.pdserve_linear_packed(
                x2.data_ptr(), int(x2.dtype == torch.bfloat16), x2.stride(0), self.packed.data_ptr(),
                _KINDS[self.packed.dtype], None if self.scale is None else self.scale.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(),
                y.data_ptr(), int(out_dtype == torch.bfloat16), y.stride(0), m, self.out_features, self.in_features)
            if rc != 0:
                raise MemoryError("linear_cpu: no memory for the kernel's scratch buffers")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = "int8" if self.scale is not None else "bf16"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"
