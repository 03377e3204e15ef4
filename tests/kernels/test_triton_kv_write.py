"""write_kv (Triton) against write_kv_ref, into the engine's strided cache views."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.kv_write import write_kv, write_kv_ref  # noqa: E402
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache, dtype_name, layer_view  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 9, 8, 3, 16


def _cache(dtype: torch.dtype, device: str) -> torch.Tensor:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                       dtype=dtype_name(dtype))
    kv = allocate_kv_cache(spec, NUM_BLOCKS, device)
    kv.copy_(torch.randn(kv.shape))  # stale data everywhere: only the written slots may change
    return kv


@pytest.mark.parametrize("src_dtype", [None, torch.float32], ids=["same-dtype", "from-fp32"])
def test_matches_reference(src_dtype, dtype, device):
    kv = _cache(dtype, device)
    kv_ref = kv.clone()
    num_tokens = 13
    # Unique slots scattered over non-adjacent blocks, partly filling some of them.
    slots = torch.randperm((NUM_BLOCKS - 1) * BLOCK_SIZE)[:num_tokens] + BLOCK_SIZE
    slots = slots.to(device)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device).to(src_dtype or dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device).to(src_dtype or dtype)

    write_kv(k, v, *layer_view(kv, 1), slots)
    write_kv_ref(k, v, *layer_view(kv_ref, 1), slots)
    # Compares the whole tensor: layer 0 and unwritten slots must be untouched.
    assert torch.equal(kv, kv_ref)


def test_negative_slots_are_skipped(device):
    kv = _cache(torch.float32, device)
    kv_ref = kv.clone()
    slots = torch.tensor([17, -1, 40, -1], device=device)
    k = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, device=device)
    v = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, device=device)
    write_kv(k, v, *layer_view(kv, 0), slots)
    keep = slots >= 0
    write_kv_ref(k[keep], v[keep], *layer_view(kv_ref, 0), slots[keep])
    assert torch.equal(kv, kv_ref)


def test_bad_arguments_are_rejected(device):
    kv = _cache(torch.float32, device)
    k_cache, v_cache = layer_view(kv, 0)
    k = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, device=device)
    slots = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="heads/dim"):
        write_kv(k[:, :2], k[:, :2], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, k_cache, v_cache, slots.float())
    expanded = k_cache[:1].expand(NUM_BLOCKS, -1, -1, -1)
    with pytest.raises(ValueError, match="expanded"):
        write_kv(k, k, expanded, expanded, slots)
