"""SiLU-and-mul for SwiGLU MLPs: torch reference and Triton kernel.

``x = cat(gate, up)`` on the last dim; the result is ``silu(gate) * up`` with
the last dim halved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import FLOAT_DTYPES, check_dtype
from kernels.triton_jit import check_launchable, lazy_jit, next_pow2, tl


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@lazy_jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, d,
    stride_xr, stride_xc,
    stride_or, stride_oc,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xr + (cols + d) * stride_xc, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the multiply, as the reference's
    # two separate torch ops do, so 16-bit results agree to the last bit.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_or + cols * stride_oc, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton ``silu_and_mul_ref``: any leading dims, any strides."""
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (cat(gate, up)), got shape {tuple(x.shape)}")
    check_launchable(x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, 2 * d)  # a view for the usual layouts; a copy only for exotic ones
    if rows.shape[0] == 0 or d == 0:
        return out
    out_rows = out.view(-1, d)
    block = min(1024, next_pow2(d))
    grid = (rows.shape[0], -(-d // block))
    _silu_and_mul_kernel[grid](
        rows, out_rows, d, rows.stride(0), rows.stride(1), out_rows.stride(0), out_rows.stride(1), BLOCK=block
    )
    return out
