"""rotary (Triton) against rotary_ref, on q/k views of a fused qkv projection."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.rotary import rotary, rotary_ref  # noqa: E402


def _cos_sin_cache(max_pos: int, head_dim: int, device: str) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 4, 16), (6, 2, 32), (8, 1, 24)],
    ids=["mha", "gqa3", "gqa8-ragged-half"],
)
def test_matches_reference(num_heads, num_kv_heads, head_dim, dtype, device):
    num_tokens = 7
    # q and k as the model has them: strided views into one qkv buffer.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    cache = _cos_sin_cache(4096, head_dim, device)
    qkv_before = qkv.clone()

    q_out, k_out = rotary(q, k, positions, cache)
    q_ref, k_ref = rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)
    assert torch.equal(qkv, qkv_before)  # new q, k; inputs not modified


def test_bad_arguments_are_rejected(device):
    q = torch.randn(3, 2, 16, device=device)
    positions = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary(q, q, positions, torch.randn(10, 8, device=device))
    with pytest.raises(ValueError, match="even"):
        rotary(q[..., :15], q[..., :15], positions, torch.randn(10, 15, device=device))
    with pytest.raises(ValueError, match="positions"):
        rotary(q, q, positions[:2], torch.randn(10, 16, device=device))
