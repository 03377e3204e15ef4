"""The bf16-weight linear kernel (linear_cpu.c) against F.linear, and the model using it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear_cpu import PackedLinear, kernel_available, pack_weight, unpack_weight

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="needs the AVX-512 build of the CPU kernels")


def test_pack_round_trips():
    w = torch.randn(45, 70).to(torch.bfloat16)
    packed = pack_weight(w)
    assert packed.shape == (2, 70, 32) and torch.equal(unpack_weight(packed, 45), w)
    assert packed[1, :, 13:].abs().sum() == 0  # columns past N are zero


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 64, 200])
@pytest.mark.parametrize("in_f,out_f", [(576, 960), (1536, 576), (70, 45)])
def test_matches_fp32_reference(rows, in_f, out_f):
    gen = torch.Generator().manual_seed(rows * in_f + out_f)
    w = torch.randn(out_f, in_f, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_f, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
    exact = F.linear(x.float(), w.float(), b.float())  # what bf16 products summed in fp32 approximate
    layer = PackedLinear(w, b)
    got32 = layer(x, out_dtype=torch.float32)
    torch.testing.assert_close(got32, exact, atol=1e-3 * in_f ** 0.5, rtol=1e-5)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, got32.to(torch.bfloat16))  # the same sums, rounded to nearest even


@needs_kernel
def test_strided_and_3d_inputs_and_fp32_activations():
    w = torch.randn(40, 64).to(torch.bfloat16)
    layer = PackedLinear(w)
    x = torch.randn(3, 5, 128).to(torch.bfloat16)[..., :64]  # rows with a stride
    torch.testing.assert_close(layer(x, out_dtype=torch.float32), F.linear(x.float(), w.float()), atol=1e-4, rtol=1e-5)
    xf = torch.randn(6, 64)
    torch.testing.assert_close(layer(xf), F.linear(xf, w.float()), atol=1e-4, rtol=1e-5)
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 40)


@needs_kernel
def test_concurrent_callers_get_their_own_results():
    # two engines in one process call the kernel from two threads at once (ctypes drops the GIL);
    # each call packs its rows into scratch memory that must be its own
    from concurrent.futures import ThreadPoolExecutor

    w = torch.randn(960, 576).to(torch.bfloat16)
    layer = PackedLinear(w)
    xs = [torch.randn(rows, 576).to(torch.bfloat16) for rows in (7, 40, 130, 300)]
    want = [layer(x, out_dtype=torch.float32) for x in xs]

    def run(i):
        return all(torch.equal(layer(xs[i], out_dtype=torch.float32), want[i]) for _ in range(20))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(4)))


def test_rejects_weights_it_cannot_pack():
    with pytest.raises(ValueError, match="bf16 CPU weight"):
        PackedLinear(torch.randn(4, 4))


@needs_kernel
def test_bf16_model_on_cpu_packs_its_projections_and_keeps_its_weights_readable():
    from kernels.ops import CPU_OPS, TORCH_OPS
    from services.engine.hf_baseline import hf_twin
    from services.engine.loader import load_model
    from services.engine.model_config import preset_config
    from services.engine.model_source import ModelSource

    source = ModelSource("tiny", preset_config("tiny"), None, None)
    packed = load_model(source, CPU_OPS, torch.bfloat16, "cpu", max_positions=64)
    plain = load_model(source, TORCH_OPS, torch.bfloat16, "cpu", max_positions=64)  # same seed, same weights
    assert isinstance(packed.layers[0].self_attn.qkv_proj, PackedLinear) and packed.logits_proj is not None
    assert not isinstance(plain.layers[0].self_attn.qkv_proj, PackedLinear)
    ours, theirs = packed.checkpoint_tensors(), plain.checkpoint_tensors()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    hf = hf_twin(packed)
    assert torch.equal(hf.model.layers[1].mlp.down_proj.weight, plain.layers[1].mlp.down_proj.weight)
    # logits come out in fp32, close to the plain bf16 model's (which rounds them to bf16 first)
    hidden = torch.randn(3, packed.config.hidden_size).to(torch.bfloat16)
    got, want = packed.compute_logits(hidden), plain.compute_logits(hidden)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
