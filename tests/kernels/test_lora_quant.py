"""Quantized LoRA stacks (kernels/lora_quant.py, --lora-dtype int8 / int4): the round trip stays on
each weight's grid, the C kernel computes what the dequantizing reference does (rows of several
adapters, none, ranks below the padding, runs of one adapter, odd widths for int8; with VNNI, what
``vnni_apply_ref`` defines, x and int4's expand coefficients in int8, and that near the dequantizing
reference), the Triton kernel takes int8 and refuses int4 with a message."""

import pytest
import torch

from kernels.lora import lora_apply_ref
from kernels.lora_quant import (GROUP, check_shapes, quantize_int4_groups, quantize_int8_rows, unpack_int4,
                                vnni_apply_ref)

BOUNDS = (0, 96, 128, 160)  # a fused qkv of hidden 96: q 96, k 32, v 32


def _c_kernel():
    from kernels import native

    if native.library() is None or not native.library().pdserve_lora_available():
        pytest.skip("the C kernels need a compiler and AVX-512")
    from kernels.lora_cpu import lora_apply_cpu
    return lora_apply_cpu


def _kernel_ref():
    """What the C kernel computes on this machine for quantized stacks: with VNNI x (and int4's expand
    coefficients) in int8, else the dequantizing reference."""
    from kernels.lora_cpu import x_quantized

    return vnni_apply_ref if x_quantized() else lora_apply_ref


def quantize_stacks(a: torch.Tensor, bt: torch.Tensor, bounds, fmt: str):
    """Float stacks ``a [S, nseg*R, K]``, ``bt [S, R, N]`` in the store's layout (lora_slots.py)."""
    S, R, N = bt.shape
    if fmt == "int8":
        qa, sa = zip(*(quantize_int8_rows(a[s]) for s in range(S)))
        qb, sb = [], []
        for s in range(S):
            parts = [quantize_int8_rows(bt[s, :, lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
            qb.append(torch.cat([q for q, _ in parts], dim=1))
            sb.append(torch.cat([sc for _, sc in parts]))
    else:
        qa, sa = zip(*(quantize_int4_groups(a[s]) for s in range(S)))
        qb, sb = zip(*(quantize_int4_groups(bt[s]) for s in range(S)))
    return torch.stack(qa), torch.stack(qb), (torch.stack(sa), torch.stack(sb))


def _case(rank=16, rows=(0, -1, 1, 2, 0, -1, 2), k=96, bounds=BOUNDS, R=None):
    R = R or rank
    nseg, n = len(bounds) - 1, bounds[-1]
    a = torch.randn(3, nseg * R, k) * 0.2
    bt = torch.randn(3, R, n) * 0.2
    ranks = torch.tensor([rank, max(1, rank // 2), min(rank, 4)], dtype=torch.int32)
    for s, r in enumerate(ranks.tolist()):  # the store's zero padding past each slot's rank
        for seg in range(nseg):
            a[s, seg * R + r:(seg + 1) * R] = 0
        bt[s, r:] = 0
    idx = torch.tensor(rows, dtype=torch.int32)
    x = torch.randn(len(rows), k).to(torch.bfloat16)
    y = torch.randn(len(rows), n).to(torch.bfloat16)
    return y, x, a, bt, idx, ranks


def test_round_trip_stays_within_half_a_step():
    w = torch.randn(8, 4 * GROUP) * torch.logspace(-3, 1, 8)[:, None]  # rows of very different sizes
    w[3] = 0
    q8, s8 = quantize_int8_rows(w)
    assert q8.dtype == torch.int8 and s8.shape == (8,)
    assert ((q8.float() * s8[:, None] - w).abs() <= s8[:, None] / 2 + 1e-7).all()
    p4, s4 = quantize_int4_groups(w)
    assert p4.dtype == torch.uint8 and p4.shape == (8, 2 * GROUP) and s4.shape == (8, 4)
    back = unpack_int4(p4, s4)
    step = s4.float().repeat_interleave(GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6 * w.abs()).all()
    assert torch.equal(back[3], w[3]) and torch.equal(q8[3], torch.zeros_like(q8[3]))
    # the grid is coarse enough to matter: int4 is further off than int8
    assert (back - w).abs().mean() > 4 * (q8.float() * s8[:, None] - w).abs().mean()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_c_kernel_matches_dequantizing_reference(fmt, rank):
    lora_apply_cpu = _c_kernel()
    y, x, a, bt, idx, ranks = _case(rank=rank)
    qa, qb, scales = quantize_stacks(a, bt, BOUNDS, fmt)
    want, got, exact, dequant = y.clone(), y.clone(), y.clone(), y.clone()
    _kernel_ref()(want, x, qa, qb, BOUNDS, idx, scales=scales)
    lora_apply_cpu(got, x, qa, qb, BOUNDS, idx, ranks, scales=scales)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
    assert torch.equal(got[1], y[1]) and torch.equal(got[5], y[5])  # rows without an adapter
    lora_apply_ref(exact, x, a.to(torch.bfloat16), bt.to(torch.bfloat16), BOUNDS, idx)
    delta, err = (exact.float() - y.float()), (got.float() - exact.float())
    assert err.abs().max() > 0  # quantized: not the bf16 result ...
    assert err.norm() < (0.05 if fmt == "int8" else 0.3) * delta.norm()  # ... but near it
    # the int8 x (and coefficients) cost far less than the weights' own rounding
    lora_apply_ref(dequant, x, qa, qb, BOUNDS, idx, scales=scales)
    assert (got.float() - dequant.float()).norm() < 0.03 * delta.norm()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("bounds", [BOUNDS, (0, 64, 128, 192)])
def test_c_kernel_rows_sharing_an_adapter(fmt, bounds):
    lora_apply_cpu = _c_kernel()
    rows = [0, 0, 0, 0, 0, 1, 1, -1, 2, 2, 2, 0, 1, 1, 1, 1, -1, -1, 2, 0, 0]
    y, x, a, bt, idx, ranks = _case(rank=16, rows=rows, bounds=bounds)
    qa, qb, scales = quantize_stacks(a, bt, bounds, fmt)
    want, got = y.clone(), y.clone()
    _kernel_ref()(want, x, qa, qb, bounds, idx, scales=scales)
    lora_apply_cpu(got, x, qa, qb, bounds, idx, ranks, scales=scales)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
    assert torch.equal(got[7], y[7]) and torch.equal(got[16:18], y[16:18])


INT8_ROWS, INT4_ROWS = (2, -1, 0, 1, 2), (2, -1, 0, 1, 2, 0)


@pytest.mark.parametrize("dtype, k, bounds, rank, R, rows", [
    # int8 takes any width (masked tails), a segment wider than one expand pass, empty segments; segments
    # on 64-column blocks (the VNNI expand) across a pass's end, a rank off its blocks of four
    ("int8", 100, (0, 70, 83, 2200), 13, 64, INT8_ROWS), ("int8", 40, (0, 0, 33, 33), 6, 64, INT8_ROWS),
    ("int8", 96, (0, 64, 128, 4224), 13, 64, INT8_ROWS), ("int8", 576, (0, 576, 768, 960), 64, 64, INT8_ROWS),
    # int4: an output wider than one expand pass (4096 columns) ending mid-pass, K not a multiple of the VNNI
    # shrink's 128, a rank off the expand's blocks of four, empty segments, a stack rank off them (fp32 expand)
    ("int4", 96, (0, 64, 64, 4160), 64, 64, INT4_ROWS), ("int4", 544, (0, 32, 96, 96), 5, 8, INT4_ROWS),
    ("int4", 64, (0, 0, 64, 64), 8, 8, INT4_ROWS), ("int4", 96, (0, 32, 64, 96), 6, 6, INT4_ROWS)])
def test_c_kernel_quantized_odd_shapes(dtype, k, bounds, rank, R, rows):
    """The C kernel equals the reference on shapes off its fast paths; a row without adapter is untouched."""
    lora_apply_cpu = _c_kernel()
    y, x, a, bt, idx, ranks = _case(rank=rank, rows=rows, k=k, bounds=bounds, R=R)
    qa, qb, scales = quantize_stacks(a, bt, bounds, dtype)
    want, got = y.clone(), y.clone()
    _kernel_ref()(want, x, qa, qb, bounds, idx, scales=scales)
    lora_apply_cpu(got, x, qa, qb, bounds, idx, ranks, scales=scales)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
    assert torch.equal(got[1], y[1]) and not torch.equal(got[0], y[0])


def test_int4_refuses_widths_off_its_groups():
    check_shapes("int4", {"qkv": (64, (0, 64, 96, 128))})
    with pytest.raises(ValueError, match="multiples of 32.*int8"):
        check_shapes("int4", {"qkv": (100, (0, 70, 83, 96))})
    check_shapes("int8", {"qkv": (100, (0, 70, 83, 96))})
    with pytest.raises(ValueError, match="lora_dtype"):
        check_shapes("fp8", {})


def test_triton_int8_matches_reference_and_int4_is_refused(device, dtype):
    pytest.importorskip("triton")
    from kernels.lora import lora_apply

    y, x, a, bt, idx, ranks = _case(rank=16)
    qa, qb, scales = quantize_stacks(a, bt, BOUNDS, "int8")
    to = dict(device=device)
    y, x, idx, ranks = y.to(dtype=dtype, **to), x.to(dtype=dtype, **to), idx.to(**to), ranks.to(**to)
    qa, qb, scales = qa.to(**to), qb.to(**to), tuple(s.to(**to) for s in scales)
    want, got = y.clone(), y.clone()
    lora_apply_ref(want, x, qa, qb, BOUNDS, idx, scales=scales)
    lora_apply(got, x, qa, qb, BOUNDS, idx, ranks, scales=scales)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(got[1], y[1])
    qa4, qb4, scales4 = quantize_stacks(a, bt, BOUNDS, "int4")
    with pytest.raises(ValueError, match="int4 LoRA stacks run on the CPU"):
        lora_apply(y.clone(), x, qa4.to(**to), qb4.to(**to), BOUNDS, idx, ranks,
                   scales=tuple(s.to(**to) for s in scales4))
