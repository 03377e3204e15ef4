"""Batched LoRA for a batch that mixes adapters (Punica / S-LoRA's gathered matmul): torch
reference and Triton kernel.

Every row ``t`` of a projection's input ``x [T, K]`` names an adapter slot ``idx[t]`` (-1: none).
A projection's adapters are stacked per slot: ``a [S, nseg * R, K]`` (lora_A, one block of R rows
per output segment: q, k, v of a fused qkv projection; gate, up of gate_up) and
``bt [S, R, N]`` (lora_B transposed, the adapter's scaling folded in, ranks below R zero-padded).
Segment ``s`` owns the output columns ``bounds[s]:bounds[s + 1]``::

    y[t, bounds[s]:bounds[s+1]] += (a[idx[t], s*R:(s+1)*R] @ x[t]) @ bt[idx[t], :, bounds[s]:bounds[s+1]]

in fp32, ``y`` rounded once to its dtype. The C kernel (lora_cpu.c) computes the same.

Quantized stacks (``--lora-dtype int8`` / ``int4``, kernels/lora_quant.py) come with
``scales = (a_scale, bt_scale)``; the reference dequantizes each slot it uses, the Triton kernels
take int8 (its per-row scales fold into ``u``) and refuse int4.
"""

from __future__ import annotations

import torch

from kernels.checks import FLOAT_DTYPES, check_dtype
from kernels.lora_quant import dequantize_slot, stack_format
from kernels.triton_jit import check_launchable, lazy_jit, next_pow2, tl


def lora_apply_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   bounds: tuple[int, ...], idx: torch.Tensor, ranks: torch.Tensor | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``y += LoRA(x)`` in place, rows grouped by slot (one pair of matmuls per adapter)."""
    rank = bt.shape[1]
    for slot in idx.unique().tolist():
        if slot < 0:
            continue
        rows = (idx == slot).nonzero().squeeze(1)
        if scales is None:
            a_s, bt_s = a[slot].float(), bt[slot].float()
        else:
            a_s, bt_s = dequantize_slot(a[slot], bt[slot], scales[0][slot], scales[1][slot], bounds)
        u = x.index_select(0, rows).float() @ a_s.T  # [n, nseg * R]
        delta = torch.cat([u[:, s * rank:(s + 1) * rank] @ bt_s[:, lo:hi]
                           for s, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], dim=1)
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


@lazy_jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, u_ptr, sa_ptr, sb_ptr, K,
                   stride_xt, stride_as, stride_ar, stride_ut, stride_ss,
                   R: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
    # one program per (row, segment, K block), split-K: u[t, seg*R : seg*R + R] += a[slot, seg*R : ..., kb] @ x[t, kb]
    # (u starts at zero; a batch of 8 rows is 8 x 3 programs without the split, a few percent of a GPU's cores,
    # each reading R x K of its adapter alone). int8 stacks, SCALED: times the rows' A and B^T scales, which
    # makes the expand's int8 B exact (a sum of scaled partials is the scaled sum).
    t = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, R)
        k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < K
        xv = tl.load(x_ptr + t * stride_xt + k, mask=km, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + slot * stride_as + (seg * R + r)[:, None] * stride_ar + k[None, :],
                     mask=km[None, :], other=0.0).to(tl.float32)
        acc = tl.sum(av * xv[None, :], axis=1)
        if SCALED:
            acc *= tl.load(sa_ptr + slot * stride_ss + seg * R + r) * tl.load(sb_ptr + slot * stride_ss + seg * R + r)
        tl.atomic_add(u_ptr + t * stride_ut + seg * R + r, acc)


@lazy_jit
def _expand_kernel(y_ptr, u_ptr, bt_ptr, idx_ptr, bounds_ptr, N, NSEG,
                   stride_yt, stride_ut, stride_bs, stride_br,
                   R: tl.constexpr, BLOCK_N: tl.constexpr):
    # one program per (row, column block): y[t, n] += u[t, seg(n)*R : +R] . bt[slot, :, n]
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        seg = tl.zeros((BLOCK_N,), dtype=tl.int32)
        for s in range(1, NSEG):
            seg += (n >= tl.load(bounds_ptr + s)).to(tl.int32)
        r = tl.arange(0, R)
        uv = tl.load(u_ptr + t * stride_ut + seg[None, :] * R + r[:, None], mask=nm[None, :], other=0.0)
        bv = tl.load(bt_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :], mask=nm[None, :],
                     other=0.0).to(tl.float32)
        delta = tl.sum(uv * bv, axis=0)
        yp = y_ptr + t * stride_yt + n
        yv = tl.load(yp, mask=nm, other=0.0).to(tl.float32)
        tl.store(yp, (yv + delta).to(y_ptr.dtype.element_ty), mask=nm)


_BOUNDS: dict[tuple, torch.Tensor] = {}


def _bounds_on(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A projection's segment bounds on ``device``, copied there once: a copy from host memory per call
    would be a synchronizing copy each step, and is not allowed while a CUDA graph is being captured."""
    key = (tuple(bounds), str(device))
    if key not in _BOUNDS:
        _BOUNDS[key] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return _BOUNDS[key]


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               bounds: tuple[int, ...], idx: torch.Tensor, ranks: torch.Tensor | None = None,
               scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Triton ``lora_apply_ref``: a split-K shrink kernel (row, segment, K block) into fp32 ``u``, then an expand
    kernel (row, column block) adding ``u @ bt`` to ``y``; rows without an adapter return at once."""
    fmt = stack_format(a)
    if fmt == "int4":
        raise ValueError("lora_apply: int4 LoRA stacks run on the CPU kernels only; use --lora-dtype int8 or bf16 "
                         "on a GPU")
    if fmt == "int8" and (scales is None or stack_format(bt) != "int8"):
        raise ValueError("lora_apply: int8 stacks need both int8 (a_scale, bt_scale)")
    for name, t in (("y", y), ("x", x), *((("a", a), ("bt", bt)) if fmt == "bf16" else ())):
        check_dtype(name, t, FLOAT_DTYPES)
    for t in (y, x, a, bt):
        check_launchable(t)
    T, K = x.shape
    S, R, N = bt.shape
    nseg = len(bounds) - 1
    if (y.shape != (T, N) or a.shape != (S, nseg * R, K) or idx.shape != (T,) or bounds[-1] != N
            or R & (R - 1) or x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not bt.is_contiguous()):
        raise ValueError(f"lora_apply: shapes y {tuple(y.shape)} x {tuple(x.shape)} a {tuple(a.shape)} "
                         f"bt {tuple(bt.shape)} bounds {bounds} idx {tuple(idx.shape)} do not fit "
                         "(R a power of two, unit-stride rows, contiguous stacks)")
    if T == 0:
        return
    idx = idx.to(device=x.device, dtype=torch.int32).contiguous()
    u = torch.zeros((T, nseg * R), dtype=torch.float32, device=x.device)  # the split-K shrink adds into it
    sa, sb = scales if fmt == "int8" else (u, u)  # unread unless SCALED
    if fmt == "int8" and (sa.shape != (S, nseg * R) or sb.shape != (S, nseg * R) or not sa.is_contiguous()
                          or not sb.is_contiguous()):
        raise ValueError(f"lora_apply: int8 scales must be contiguous [{S}, {nseg * R}]")
    block_k = min(128, next_pow2(K))
    _shrink_kernel[(T, nseg, -(-K // block_k))](x, a, idx, u, sa, sb, K, x.stride(0), a.stride(0), a.stride(1),
                                               u.stride(0), sa.stride(0), R=R, BLOCK_K=block_k,
                                               SCALED=fmt == "int8")
    bounds_t = _bounds_on(bounds, x.device)
    block_n = min(128, next_pow2(N))
    _expand_kernel[(T, -(-N // block_n))](y, u, bt, idx, bounds_t, N, nseg, y.stride(0), u.stride(0),
                                          bt.stride(0), bt.stride(1), R=R, BLOCK_N=block_n)
