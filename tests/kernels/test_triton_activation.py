"""silu_and_mul (Triton) against silu_and_mul_ref."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 32), (7, 80), (2, 3, 48)], ids=["one-row", "ragged-d", "3d"])
def test_matches_reference(shape, dtype, device):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    out = silu_and_mul(x)
    ref = silu_and_mul_ref(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref)


def test_strided_rows(dtype, device):
    # Rows of a wider buffer: the kernel must use the row stride, not 2 * d.
    wide = torch.randn(5, 100, device=device).to(dtype)
    x = wide[:, 10:74]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))


def test_odd_last_dim_is_rejected(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7, device=device))
