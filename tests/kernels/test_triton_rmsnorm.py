"""rms_norm (Triton) against rms_norm_ref, with and without the fused residual add."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402


@pytest.mark.parametrize("shape", [(3, 64), (5, 48), (2, 3, 40)], ids=["pow2", "ragged", "3d"])
@pytest.mark.parametrize("fp32_weight", [False, True], ids=["weight-like-x", "fp32-weight"])
def test_matches_reference(shape, fp32_weight, dtype, device):
    x = torch.randn(shape, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(torch.float32 if fp32_weight else dtype)
    out = rms_norm(x, weight, 1e-6)
    ref = rms_norm_ref(x, weight, 1e-6)
    assert out.dtype == ref.dtype  # promote(x, weight), as the reference
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("shape", [(3, 64), (4, 40)])
def test_fused_residual_matches_reference(shape, dtype, device):
    x = torch.randn(shape, device=device).to(dtype)
    residual = torch.randn(shape, device=device).to(dtype)
    weight = torch.randn(shape[-1], device=device).to(dtype)
    x_before, res_before = x.clone(), residual.clone()
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out)
    # Like the reference, the inputs are left as they were.
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


def test_strided_input(dtype, device):
    # Every other column of a wider buffer: the kernel must use the column stride.
    x = torch.randn(4, 96, device=device).to(dtype)[:, ::2]
    weight = torch.randn(48, device=device).to(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_bad_arguments_are_rejected(device):
    x = torch.randn(2, 16, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual dtype"):
        rms_norm(x, torch.ones(16, device=device), 1e-6, x.half())
