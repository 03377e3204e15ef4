"""The CPU C kernels for the model's small ops (fused_cpu.c) against their torch references.

bf16 results must equal the reference's to the last bit except where fp32 evaluation
order differs (a sum of squares, a division): there, at most one bf16 ulp apart.
Other dtypes and layouts must fall back to the reference exactly.
"""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.activation import silu_and_mul_ref
from kernels.fused_cpu import rms_norm_cpu, rotary_cpu, silu_and_mul_cpu, write_kv_cpu
from kernels.kv_write import write_kv_ref
from kernels.rmsnorm import rms_norm_ref
from kernels.rotary import rotary_ref
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache, layer_view
from services.engine.rope import build_cos_sin_cache

pytestmark = pytest.mark.skipif(native.library() is None or not native.library().pdserve_fused_available(),
                                reason="needs the AVX-512 build of the CPU kernels")


def within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(diff.max()) <= 1, f"{int((diff > 1).sum())} elements differ by more than one bf16 ulp"
    assert (diff == 0).float().mean() > 0.95, "most elements should be bit-identical"


@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (300, 200), (5, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    res = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16) if with_residual else None
    got, want = rms_norm_cpu(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        within_one_ulp(got[0], want[0])
        assert torch.equal(got[1], want[1])  # the rounded sum is exact
    else:
        within_one_ulp(got, want)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (50, 9, 3, 64), (7, 4, 2, 40)])
def test_rotary_matches_reference_in_place_on_strided_views(tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided, as the model's q and k
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    table = build_cos_sin_cache(head_dim, 4096, 100000.0, None)
    want_q, want_k = rotary_ref(q, k, positions, table)
    got_q, got_k = rotary_cpu(q, k, positions, table)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    within_one_ulp(got_q, want_q)
    within_one_ulp(got_k, want_k)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (3, 45)])
def test_silu_and_mul_matches_reference(rows, inter):
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(torch.bfloat16)
    within_one_ulp(silu_and_mul_cpu(x), silu_and_mul_ref(x))


def test_silu_saturates_without_nan():
    x = torch.tensor([[-200.0, -88.0, 0.0, 88.0, 200.0] + [1.0] * 5], dtype=torch.bfloat16)
    got = silu_and_mul_cpu(x)
    assert torch.isfinite(got).all()
    within_one_ulp(got, silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_matches_reference(dtype):
    spec = KVCacheSpec(2, 3, 64, 16, "bfloat16" if dtype == torch.bfloat16 else "float32")
    ours, theirs = allocate_kv_cache(spec, 20), allocate_kv_cache(spec, 20)
    kv = torch.randn(9, 2 * 3 * 64).to(dtype)
    k, v = kv[:, :192].view(9, 3, 64), kv[:, 192:].view(9, 3, 64)
    slots = torch.tensor([17, 18, 40, 41, 42, 5, 300, 301, 100], dtype=torch.int64)
    write_kv_cpu(k, v, *layer_view(ours, 1), slots)
    write_kv_ref(k, v, *layer_view(theirs, 1), slots)
    assert torch.equal(ours, theirs)


def test_other_dtypes_fall_back_to_the_references():
    x = torch.randn(4, 32)
    w = torch.rand(32)
    assert torch.equal(rms_norm_cpu(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert torch.equal(silu_and_mul_cpu(x), silu_and_mul_ref(x))
