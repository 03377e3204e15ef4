"""Quantized LoRA stacks (``--lora-dtype int8`` / ``int4``): the layouts, quantizing at load and the
dequantizing torch reference.

Why: a decode step in which every row has its own adapter reads each row's A and B once, two
flops a weight, so on a CPU it is bound by the bytes it reads (at rank 64 and batch 8, eight
bf16 adapters of SmolLM2-135M are 312 MB a step against 212 MB of base weights). Fewer bytes
per weight is the only lever; the numbers change, so it is opt-in and bf16 stays the default.

Layouts per slot of a projection's stacks (``a [S, nseg*R, K]``, ``bt [S, R, N]``, kernels/lora.py):

- ``int8``: symmetric int8, one fp32 scale per rank row and segment: ``a_scale [S, nseg*R]``
  (row ``s*R + j`` of A over its K inputs) and ``bt_scale [S, nseg*R]`` (row j of B^T over
  segment s's columns). Both fold into the shrink's output ``u``, so the kernel's inner loops
  only widen int8 (lora_cpu.c). 1 byte a weight.
- ``int4``: symmetric int4 in groups of ``GROUP`` consecutive elements of a row, one bf16 scale
  per group (``a_scale [S, nseg*R, K/GROUP]``, ``bt_scale [S, R, N/GROUP]``), two elements a byte
  (element 2i in the low nibble, 2i+1 in the high, each stored + 8): 0.5625 bytes a weight.
  K and every segment bound must be multiples of ``GROUP``.

Scales are computed from the rounded scale (the value the kernel multiplies by), so the only
error is the rounding of each weight to its grid; an all-zero row gets scale 0 and stays 0.
"""

from __future__ import annotations

import torch

FORMATS = ("bf16", "int8", "int4")  # "bf16": the stacks in the model's dtype, exact
CODES = {"bf16": 0, "int8": 1, "int4": 2}  # lora_cpu.c's LORA_BF16 / INT8 / INT4
GROUP = 32


def stack_format(a: torch.Tensor) -> str:
    """A stack's format from its dtype (int8: int8; uint8: packed int4; a float dtype: bf16)."""
    return "int8" if a.dtype == torch.int8 else "int4" if a.dtype == torch.uint8 else "bf16"


def bytes_per_weight(fmt: str, dtype_bytes: int = 2) -> float:
    """What a step reads per adapter weight (scales included; int8's per-row scales are negligible)."""
    return {"bf16": dtype_bytes, "int8": 1.0, "int4": 0.5 + 2 / GROUP}[fmt]


def check_shapes(fmt: str, shapes: dict[str, tuple[int, tuple[int, ...]]]) -> None:
    """ValueError where a projection's widths do not fit ``fmt`` (int4 groups need multiples of GROUP)."""
    if fmt not in FORMATS:
        raise ValueError(f"lora_dtype must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt != "int4":
        return
    for proj, (k, bounds) in shapes.items():
        if k % GROUP or any(b % GROUP for b in bounds):
            raise ValueError(f"--lora-dtype int4 quantizes in groups of {GROUP}: the {proj} projection's input "
                             f"width {k} and output segments {bounds} must be multiples of {GROUP}; "
                             "use --lora-dtype int8 for this model")


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [r, n]`` -> (int8 [r, n], fp32 scale [r]) with ``w ~ q * scale[:, None]``."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127 if w.shape[1] else w.new_zeros(w.shape[0])  # an empty segment
    q = torch.round(w / torch.where(scale > 0, scale, 1)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [r, n]`` (n a multiple of GROUP) -> (uint8 [r, n/2] packed, bf16 scale [r, n/GROUP])."""
    r, n = w.shape
    g = w.float().reshape(r, n // GROUP, GROUP)
    scale = (g.abs().amax(dim=2) / 7).to(torch.bfloat16)
    s = scale.float()
    q = (torch.round(g / torch.where(s > 0, s, 1)[..., None]).clamp_(-8, 7) + 8).to(torch.uint8).reshape(r, n)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale


def unpack_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weights ``[..., n]`` of ``packed [..., n/2]`` with ``scale [..., n/GROUP]``."""
    lo = (packed & 15).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    q = torch.stack((lo, hi), dim=-1).flatten(-2).float()  # element 2i, 2i + 1
    return (q.unflatten(-1, (-1, GROUP)) * scale.float()[..., None]).flatten(-2)


def dequantize_slot(a: torch.Tensor, bt: torch.Tensor, a_scale: torch.Tensor, bt_scale: torch.Tensor,
                    bounds: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's quantized ``a [nseg*R, .]``, ``bt [R, .]`` -> fp32 ``a [nseg*R, K]``, ``bt [R, N]``."""
    fmt = stack_format(a)
    if fmt == "int4":
        return unpack_int4(a, a_scale), unpack_int4(bt, bt_scale)
    rank = bt.shape[0]
    a_f = a.float() * a_scale[:, None]
    bt_f = torch.cat([bt[:, lo:hi].float() * bt_scale[s * rank:(s + 1) * rank, None]
                      for s, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], dim=1)
    return a_f, bt_f


def quantize_x_groups(x: torch.Tensor) -> torch.Tensor:
    """What the C kernel's VNNI shrinks (lora_cpu.c, ``x_quantized``) multiply the quantized weights
    by: each row of ``x [T, K]`` in groups of GROUP, symmetric int8 with the group's largest |x| /
    127 as the step, as fp32 values (code x step, rounded as the kernel rounds)."""
    xf = x.float()
    t, k = xf.shape
    pad = (-k) % GROUP
    g = torch.nn.functional.pad(xf, (0, pad)).reshape(t, -1, GROUP)
    mx = g.abs().amax(dim=2, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(127.0) / mx, torch.zeros_like(mx))
    codes = torch.round(g * inv).clamp_(-127, 127)
    return (codes * (mx / 127)).reshape(t, -1)[:, :k]


def vnni_apply_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, bounds: tuple[int, ...],
                   idx: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``y += LoRA(x)`` as the C kernel's VNNI loops compute it for int8 / int4 stacks (lora_cpu.c):
    x quantized in groups (``quantize_x_groups``); and where the padded rank is a multiple of 4 the
    expand's coefficients in int8 times the integer weights: int4's ``c[j, g] = u[j] * bt_scale[j, g]``
    per output group g over the rank j (scale: the group's largest |c| / 127), int8's u[s, j] with
    both row scales per segment s (segment bounds multiples of 64; others the exact fp32 expand). The tests hold the
    kernel to this and this near the exact dequantizing reference (kernels/lora.py)."""
    from kernels.lora import lora_apply_ref

    xq = quantize_x_groups(x)
    fmt, rank = stack_format(a), bt.shape[1]
    int8_blocks = len(bounds) <= 17 and all(b % 64 == 0 for b in bounds)  # lora_cpu.c's expand8v
    if rank % 4 or (fmt == "int8" and not int8_blocks):  # the VNNI expands read B^T four rows at a time
        return lora_apply_ref(y, xq, a, bt, bounds, idx, scales=scales)
    if fmt == "int8":
        return _int8_expand_ref(y, xq, a, bt, bounds, idx, scales)
    for slot in idx.unique().tolist():
        if slot < 0:
            continue
        rows = (idx == slot).nonzero().squeeze(1)
        a_f, _ = dequantize_slot(a[slot], bt[slot], scales[0][slot], scales[1][slot], bounds)
        u = xq.index_select(0, rows) @ a_f.T  # [n, nseg * R]
        lo = (bt[slot] & 15).to(torch.int16) - 8
        hi = (bt[slot] >> 4).to(torch.int16) - 8
        q = torch.stack((lo, hi), dim=-1).flatten(-2).float()  # [R, N] integer weights
        s = scales[1][slot].float()  # [R, N / GROUP]
        delta = torch.zeros(len(rows), q.shape[1])
        for seg, (b0, b1) in enumerate(zip(bounds, bounds[1:])):
            g0, g1 = b0 // GROUP, b1 // GROUP
            c = u[:, seg * rank:(seg + 1) * rank, None] * s[None, :, g0:g1]  # [n, R, groups]
            t = c.abs().amax(dim=1, keepdim=True) / 127
            inv = torch.where(t > 0, 1 / t, torch.zeros_like(t))
            cq = torch.round(c * inv) * t
            w = q[:, b0:b1].unflatten(1, (-1, GROUP))  # [R, groups, GROUP]
            delta[:, b0:b1] = torch.einsum("nrg,rgk->ngk", cq, w).flatten(1)
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


def _int8_expand_ref(y, xq, a, bt, bounds, idx, scales) -> None:
    """vnni_apply_ref's int8 expand: the coefficients u[s, j] (both scales folded in) quantized to
    int8 per segment s over j, times B^T's codes."""
    rank = bt.shape[1]
    for slot in idx.unique().tolist():
        if slot < 0:
            continue
        rows = (idx == slot).nonzero().squeeze(1)
        u = (xq.index_select(0, rows) @ a[slot].float().T) * (scales[0][slot] * scales[1][slot]).float()
        delta = torch.zeros(len(rows), bt.shape[2])
        for seg, (b0, b1) in enumerate(zip(bounds, bounds[1:])):
            c = u[:, seg * rank:(seg + 1) * rank]
            t = c.abs().amax(dim=1, keepdim=True) / 127
            cq = torch.round(c * torch.where(t > 0, 1 / t, torch.zeros_like(t))) * t
            delta[:, b0:b1] = cq @ bt[slot, :, b0:b1].float()
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
