"""Linear layers over a GGUF file's own quantized blocks (Q4_0, Q4_1, Q8_0) on CPU, through
linear_quant.c: the blocks' bits are kept (never widened to bf16 at load), only reordered
into panels of 16 output columns the VNNI kernel streams (the layout is drawn in
linear_quant.c). Activations are quantized per block of 32 to int8 inside the kernel, as
llama.cpp does.

The references: ``dequantize_blocks`` (the file's rows -> fp32, straight from the GGUF block
definitions) and ``GGUFLinear.unpacked_weight`` (the packed records -> fp32); where the kernels
cannot run the layer multiplies by the dequantized weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native

BLOCK = 32  # weights per block, every format here
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # in the file
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # GK_* in linear_quant.c
_RECORD = {"Q4_0": 288, "Q4_1": 320, "Q8_0": 576}  # per panel and block, packed
PANEL = 16


def _halves(raw: torch.Tensor, start: int) -> torch.Tensor:
    """fp16 at byte ``start`` of every block: [N, nb] float32."""
    return raw[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def _split(raw: torch.Tensor, kind: str):
    """[N, nb, block bytes] -> d, m (or None), q [N, nb, 32] (uint8 0..15 for Q4, int8 for Q8_0)."""
    d = _halves(raw, 0)
    if kind == "Q8_0":
        return d, None, raw[..., 2:34].contiguous().view(torch.int8)
    start = 4 if kind == "Q4_1" else 2
    qs = raw[..., start : start + 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # byte j: weight j (low nibble) and j + 16 (high)
    return d, _halves(raw, 2) if kind == "Q4_1" else None, q


def dequantize_blocks(raw: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """The file's rows (``[N, nb * block bytes]`` uint8) as fp32 ``[N, in_features]``:
    Q4_0 ``d (q - 8)``, Q4_1 ``d q + m``, Q8_0 ``d q``."""
    n = raw.shape[0]
    d, m, q = _split(raw.view(n, -1, BLOCK_BYTES[kind]), kind)
    if kind == "Q4_0":
        w = d[..., None] * (q.float() - 8)
    elif kind == "Q4_1":
        w = d[..., None] * q.float() + m[..., None]
    else:
        w = d[..., None] * q.float()
    return w.reshape(n, in_features)


def pack_blocks(raw: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """The file's rows -> ``[ceil(N / 16), nb, record bytes]`` uint8 in linear_quant.c's layout
    (same bits, reordered; rows past N are zero)."""
    if kind not in KINDS:
        raise ValueError(f"GGUF block type {kind} is not served directly (Q4_0, Q4_1, Q8_0 are)")
    if in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
    n, nb = raw.shape[0], in_features // BLOCK
    if raw.shape[1] != nb * BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} rows of {in_features} weights are {nb * BLOCK_BYTES[kind]} bytes, got {raw.shape[1]}")
    blocks = raw.view(n, nb, BLOCK_BYTES[kind])
    panels = -(-n // PANEL)
    padded = blocks.new_zeros(panels * PANEL, nb, BLOCK_BYTES[kind])
    padded[:n] = blocks
    d, m, q = _split(padded, kind)

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [Np, nb, ...] -> [P, nb, 16 columns, ...]
        return t.view(panels, PANEL, nb, *t.shape[2:]).transpose(1, 2)

    def halves(t: torch.Tensor) -> torch.Tensor:
        return per_panel(t.half()).contiguous().view(torch.uint8).view(panels, nb, 2 * PANEL)

    def vectors(t: torch.Tensor, nv: int) -> torch.Tensor:  # byte 4c + i of vector v: t[c][4v + i]
        t = per_panel(t).reshape(panels, nb, PANEL, nv, 4).permute(0, 1, 3, 2, 4)
        return t.contiguous().view(torch.uint8).reshape(panels, nb, nv * 64)

    if kind == "Q8_0":
        sums = q.to(torch.int16).sum(dim=-1, dtype=torch.int16)
        parts = [halves(d), per_panel(sums).contiguous().view(torch.uint8).view(panels, nb, 2 * PANEL), vectors(q, 8)]
    else:
        qs = vectors(q[..., :16], 4) | (vectors(q[..., 16:], 4) << 4)
        parts = [halves(d)] + ([halves(m)] if kind == "Q4_1" else []) + [qs]
    return torch.cat(parts, dim=-1).contiguous()


def unpack_blocks(packed: torch.Tensor, kind: str, out_features: int) -> torch.Tensor:
    """``pack_blocks`` undone, as fp32 weights ``[out_features, nb * 32]`` (the torch path)."""
    panels, nb, _ = packed.shape

    def halves(start: int) -> torch.Tensor:  # -> [P, nb, 16]
        return packed[..., start : start + 2 * PANEL].contiguous().view(torch.float16).float()

    def vectors(start: int, nv: int, dtype) -> torch.Tensor:  # -> [P, nb, 16, nv * 4]
        t = packed[..., start : start + 64 * nv].contiguous().view(dtype).view(panels, nb, nv, PANEL, 4)
        return t.permute(0, 1, 3, 2, 4).reshape(panels, nb, PANEL, 4 * nv)

    d = halves(0)
    if kind == "Q8_0":
        w = d[..., None] * vectors(64, 8, torch.int8).float()
    else:
        qs = vectors(64 if kind == "Q4_1" else 32, 4, torch.uint8)
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        w = d[..., None] * q + (halves(32)[..., None] if kind == "Q4_1" else -8 * d[..., None])
    # [P, nb, 16, 32] -> [P * 16, nb * 32]
    return w.permute(0, 2, 1, 3).reshape(panels * PANEL, nb * BLOCK)[:out_features].contiguous()


class GGUFLinear(nn.Module):
    """``y = x @ W^T (+ b)`` with ``W`` a GGUF tensor's blocks (``raw``: its rows, uint8
    ``[out_features, nb * block bytes]``), packed once for linear_quant.c. ``out_dtype``
    defaults to ``x``'s dtype (fp32 for logits)."""

    def __init__(self, raw: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, raw.shape[0]
        self.register_buffer("packed", pack_blocks(raw, kind, in_features), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def unpacked_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by, dequantized (its activations aside)."""
        return unpack_blocks(self.packed, self.kind, self.out_features).to(dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        lib = native.library()
        if (lib is None or x.dtype not in (torch.bfloat16, torch.float32) or out_dtype not in (torch.bfloat16, torch.float32)
                or x.device.type != "cpu" or x.shape[-1] != self.in_features):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.unpacked_weight(x.dtype), bias).to(out_dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty((m, self.out_features), dtype=torch.float32 if self.bias is not None else out_dtype)
        if m:
            rc = lib.pdserve_linear_gguf(x2.data_ptr(), int(x2.dtype == torch.bfloat16), x2.stride(0),
                                         self.packed.data_ptr(), KINDS[self.kind], y.data_ptr(),
                                         int(y.dtype == torch.bfloat16), y.stride(0), m, self.out_features,
                                         self.in_features)
            if rc != 0:
                raise MemoryError("linear_quant: no memory for the quantized activations")
        if self.bias is not None:
            y = (y + self.bias).to(out_dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} blocks"
