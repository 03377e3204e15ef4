"""RMSNorm, optionally fused with the residual add: torch reference and Triton kernel.

With ``residual``: ``x = x + residual`` first, and the sum is returned as the new
residual. Normalisation runs in fp32 and casts back, as HF Llama does, so fp32
outputs match HF bit for bit.
"""

from __future__ import annotations

import torch

from kernels.checks import FLOAT_DTYPES, check_dtype, check_shape
from kernels.triton_jit import check_launchable, lazy_jit, next_pow2, tl

# Triton's cap on the elements of one tile; a row is normalised as one tile.
_MAX_HIDDEN = 1 << 20


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


@lazy_jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n, eps,
    stride_xr, stride_xc,
    stride_rr, stride_rc,
    stride_or, stride_oc,
    stride_ror, stride_roc,
    stride_w,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rr + cols * stride_rc, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to x's dtype before it is normalised, exactly as the
        # reference's separate ``x + residual`` does.
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ror + cols * stride_roc, x, mask=mask)
        x = x.to(tl.float32)
    # sqrt_rn: IEEE-rounded like torch.rsqrt on CPU (tl.sqrt may be approximate on GPU).
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n + eps)
    # Rounding to x's dtype before the weight multiply mirrors ``weight * h.to(x.dtype)``.
    h = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_or + cols * stride_oc, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rms_norm_ref``. ``residual`` must match ``x`` in shape and dtype;
    the output dtype is ``promote(x, weight)``, as in the reference."""
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim (the normalised one)")
    hidden = x.shape[-1]
    check_shape("weight", weight, (hidden,), "[hidden]")
    if not 0 < hidden <= _MAX_HIDDEN:
        raise ValueError(f"hidden size must be in 1..{_MAX_HIDDEN}, got {hidden}")
    if residual is not None:
        check_shape("residual", residual, x.shape, "(same as x)")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} must match x dtype {x.dtype}")
        check_launchable(x, weight, residual)
    else:
        check_launchable(x, weight)

    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    rows = x.reshape(-1, hidden)  # a view for the usual layouts
    res_rows = residual.reshape(-1, hidden) if residual is not None else rows
    out_rows = out.view(-1, hidden)
    res_out_rows = res_out.view(-1, hidden) if res_out is not None else out_rows
    if rows.shape[0] > 0:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight,
            out_rows,
            res_out_rows,
            hidden,
            float(eps),
            rows.stride(0),
            rows.stride(1),
            res_rows.stride(0),
            res_rows.stride(1),
            out_rows.stride(0),
            out_rows.stride(1),
            res_out_rows.stride(0),
            res_out_rows.stride(1),
            weight.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, res_out)
