"""Batched LoRA, a slot per row (kernels/lora.py): the Triton kernel and the C kernel against the
torch reference, with rows of several adapters, rows without one, ranks below the padded rank,
and the segments of a fused projection. On CUDA when present, else Triton's interpreter."""

import pytest
import torch

from kernels.lora import lora_apply_ref

Q, KV = 96, 32  # a fused qkv projection of hidden 96: q 96, k 32, v 32 columns
BOUNDS = (0, Q, Q + KV, Q + 2 * KV)


def _case(device, dtype, rank: int = 16, slots: int = 3, rows: int = 7):
    n, k = BOUNDS[-1], Q
    a = torch.randn(slots, 3 * rank, k, device=device) * 0.2
    bt = torch.randn(slots, rank, n, device=device) * 0.2
    ranks = torch.tensor([rank, rank // 2, 4][:slots], dtype=torch.int32, device=device)
    for s, r in enumerate(ranks.tolist()):  # zero padding past each slot's own rank
        for seg in range(3):
            a[s, seg * rank + r:(seg + 1) * rank] = 0
        bt[s, r:] = 0
    x = torch.randn(rows, k, device=device).to(dtype)
    y = torch.randn(rows, n, device=device).to(dtype)
    idx = torch.tensor([0, -1, 1, 2, 0, -1, 2][:rows], dtype=torch.int32, device=device)
    return y, x, a.to(dtype), bt.to(dtype), idx, ranks


def test_reference_is_the_per_row_definition():
    y, x, a, bt, idx, ranks = _case("cpu", torch.float32)
    want = y.clone()
    for t, slot in enumerate(idx.tolist()):
        if slot >= 0:
            u = a[slot] @ x[t]
            for s, (lo, hi) in enumerate(zip(BOUNDS, BOUNDS[1:])):
                want[t, lo:hi] += u[s * 16:(s + 1) * 16] @ bt[slot, :, lo:hi]
    got = y.clone()
    lora_apply_ref(got, x, a, bt, BOUNDS, idx)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], y[1]) and not torch.equal(got[0], y[0])


@pytest.mark.parametrize("rank", [8, 64])
def test_triton_matches_reference(rank, dtype, device):
    pytest.importorskip("triton")
    from kernels.lora import lora_apply

    y, x, a, bt, idx, ranks = _case(device, dtype, rank=rank)
    want, got = y.clone(), y.clone()
    lora_apply_ref(want, x, a, bt, BOUNDS, idx)
    lora_apply(got, x, a, bt, BOUNDS, idx, ranks)
    torch.testing.assert_close(got, want, atol=2e-2 if dtype != torch.float32 else 1e-4, rtol=1e-2)
    assert torch.equal(got[1], y[1])  # a row without an adapter is untouched


@pytest.mark.parametrize("rank", [8, 16, 64])
def test_cpu_kernel_matches_reference(rank):
    from kernels import native
    from kernels.lora_cpu import lora_apply_cpu

    if native.library() is None or not native.library().pdserve_lora_available():
        pytest.skip("the C kernels need a compiler and AVX-512")
    y, x, a, bt, idx, ranks = _case("cpu", torch.bfloat16, rank=rank)
    want, got = y.clone(), y.clone()
    lora_apply_ref(want, x, a, bt, BOUNDS, idx)
    lora_apply_cpu(got, x, a, bt, BOUNDS, idx, ranks)
    # fp32 sums in another order, one bf16 rounding: at most one ulp apart
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
    assert torch.equal(got[1], y[1])


def test_cpu_kernel_reads_only_each_slots_rank():
    """Values past a slot's rank (the padding) must not be read: garbage there changes nothing."""
    from kernels import native
    from kernels.lora_cpu import lora_apply_cpu

    if native.library() is None or not native.library().pdserve_lora_available():
        pytest.skip("the C kernels need a compiler and AVX-512")
    y, x, a, bt, idx, ranks = _case("cpu", torch.bfloat16)
    clean = y.clone()
    lora_apply_cpu(clean, x, a, bt, BOUNDS, idx, ranks)
    bt[1, 8:] = 100  # slot 1 has rank 8
    dirty = y.clone()
    lora_apply_cpu(dirty, x, a, bt, BOUNDS, idx, ranks)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("k, bounds, rank", [(100, (0, 70, 83, 2200), 13), (1536, (0, 4200, 8400), 64),
                                             (40, (0, 0, 33, 33), 6)])
def test_cpu_kernel_odd_shapes(k, bounds, rank):
    """Sizes that are not multiples of the kernel's 32-column blocks or its 4 rank rows per pass, a
    segment wider than one expand pass (2048 columns) and empty segments."""
    from kernels import native
    from kernels.lora_cpu import lora_apply_cpu

    if native.library() is None or not native.library().pdserve_lora_available():
        pytest.skip("the C kernels need a compiler and AVX-512")
    nseg, n, R = len(bounds) - 1, bounds[-1], 64
    a = (torch.randn(3, nseg * R, k) * 0.1).to(torch.bfloat16)
    bt = (torch.randn(3, R, n) * 0.1).to(torch.bfloat16)
    for seg in range(nseg):  # the padding past the rank is zero in the engine's stacks
        a[:, seg * R + rank:(seg + 1) * R] = 0
    bt[:, rank:] = 0
    ranks = torch.tensor([rank] * 3, dtype=torch.int32)
    x = torch.randn(5, k).to(torch.bfloat16)
    y = torch.randn(5, n).to(torch.bfloat16)
    idx = torch.tensor([2, -1, 0, 1, 2], dtype=torch.int32)
    want, got = y.clone(), y.clone()
    lora_apply_ref(want, x, a, bt, bounds, idx)
    lora_apply_cpu(got, x, a, bt, bounds, idx, ranks)
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
    assert torch.equal(got[1], y[1])
    if n > 33:
        assert not torch.equal(got[0], y[0])


def test_cpu_kernel_rows_sharing_an_adapter():
    """A prefill's rows: runs of one adapter (read once for up to four rows), split across the
    kernel's chunks, beside rows of others and of none."""
    from kernels import native
    from kernels.lora_cpu import lora_apply_cpu

    if native.library() is None or not native.library().pdserve_lora_available():
        pytest.skip("the C kernels need a compiler and AVX-512")
    y, x, a, bt, _, ranks = _case("cpu", torch.bfloat16, rank=16)
    rows = [0, 0, 0, 0, 0, 1, 1, -1, 2, 2, 2, 0, 1, 1, 1, 1, -1, -1, 2, 0, 0]
    idx = torch.tensor(rows, dtype=torch.int32)
    x = torch.randn(len(rows), x.shape[1]).to(torch.bfloat16)
    y = torch.randn(len(rows), y.shape[1]).to(torch.bfloat16)
    want, got = y.clone(), y.clone()
    lora_apply_ref(want, x, a, bt, BOUNDS, idx)
    lora_apply_cpu(got, x, a, bt, BOUNDS, idx, ranks)
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
    assert torch.equal(got[7], y[7]) and torch.equal(got[16:18], y[16:18])
