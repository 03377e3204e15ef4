"""The packed linear kernels (linear_cpu.c, linear_amx.c) against F.linear on the weights they
hold (bf16, or int8 dequantized), at every CPU kernel level this machine can run, and the model
using them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_isa, native
from kernels.linear_cpu import PackedLinear, dequantize_int8, kernel_available, pack_weight, quantize_int8, unpack_weight

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
    with pytest.raises(ValueError, match="bf16 or int8 CPU weight"):
        PackedLinear(torch.randn(4, 4))
    with pytest.raises(ValueError, match="per-row scale"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="scale has shape"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.int8), scale=torch.ones(3))


def test_int8_quantization_is_per_output_channel_and_symmetric():
    w = torch.randn(6, 50)
    w[2] *= 100  # one loud row must not coarsen the others
    w[4] = 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (6,) and q.abs().max() <= 127
    assert torch.equal(q.abs().amax(dim=1)[[0, 1, 2, 3, 5]], torch.full((5,), 127, dtype=torch.int8))
    assert torch.equal(q[4], torch.zeros(50, dtype=torch.int8)) and scale[4] == 1
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()  # rounding to nearest: half a step at most


# the rows that choose each path: 1-4 (two accumulator sets), 5-31 (MR blocks), 32+ (AMX tiles
# where the level has them), 96+ (panels widened once), 200 (two row chunks of the FMA kernel)
ROWS = [1, 3, 5, 13, 32, 47, 100, 200]


@pytest.fixture(params=cpu_isa.available())
def level(request):
    """Every CPU kernel level this machine can run, forced in turn (the lower ones are the
    fallbacks other CPUs get)."""
    previous = cpu_isa.force(request.param)
    assert native.library() is not None and native.level() == request.param
    yield request.param
    cpu_isa.force(previous)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_every_level_matches_the_reference(level, weights):
    gen = torch.Generator().manual_seed(7)
    for in_f, out_f in [(576, 960), (70, 45)]:
        w = torch.randn(out_f, in_f, generator=gen)
        b = torch.randn(out_f, generator=gen).to(torch.bfloat16)
        layer = PackedLinear(w.to(torch.bfloat16), b) if weights == "bf16" else PackedLinear.quantized(w, b)
        held = layer.unpacked_weight(torch.float32)  # bf16 weights, or int8 ones dequantized
        if weights == "int8":
            q, scale = quantize_int8(w)
            assert torch.equal(held, dequantize_int8(q, scale))
        for rows in ROWS:
            x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
            exact = F.linear(x.float(), held, b.float())
            got = layer(x, out_dtype=torch.float32)
            torch.testing.assert_close(got, exact, atol=2e-3 * in_f ** 0.5, rtol=1e-4,
                                       msg=lambda m: f"{level}, {weights}, {rows} rows: {m}")
            assert torch.equal(layer(x), got.to(torch.bfloat16))  # the same sums, rounded to nearest even


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_portable_loop_matches_the_vector_kernels(weights):
    # the avx2 / generic levels run linear_portable; at any level it can be called directly
    lib = native.library()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(100, 80, generator=gen)
    layer = PackedLinear(w.to(torch.bfloat16)) if weights == "bf16" else PackedLinear.quantized(w)
    x = torch.randn(9, 80, generator=gen).to(torch.bfloat16)
    y = torch.empty(9, 100)
    assert lib.pdserve_linear_packed_portable(
        x.data_ptr(), 1, x.stride(0), layer.packed.data_ptr(), int(weights == "int8"),
        None if layer.scale is None else layer.scale.data_ptr(), None, y.data_ptr(), 0, y.stride(0), 9, 100, 80) == 0
    torch.testing.assert_close(y, layer(x, out_dtype=torch.float32), atol=1e-4, rtol=1e-5)


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
