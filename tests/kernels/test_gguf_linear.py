"""GGUF-block linear layers (linear_quant.c through kernels/gguf_linear.py): the packed
records hold the file's weights bit for bit, and the product equals llama.cpp's definition
(activations quantized per block of 32 to int8, exact integer dot products, fp32 scales) at
every CPU kernel level this machine can run."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_isa, native
from kernels.gguf_linear import BLOCK, BLOCK_BYTES, GGUFLinear, dequantize_blocks, pack_blocks, unpack_blocks

KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def random_blocks(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of valid GGUF blocks: fp16 scales (and mins), random quants."""
    nb = k // BLOCK
    raw = torch.randint(0, 256, (n, nb, BLOCK_BYTES[kind]), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, nb, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8).view(n, nb, 2)
    raw[..., 0:2] = d
    if kind == "Q4_1":
        raw[..., 2:4] = (torch.rand(n, nb, generator=gen) * -0.1).half().view(torch.uint8).view(n, nb, 2)
    if kind == "Q8_0":  # quants in -127..127 like the format's
        q = torch.randint(-127, 128, (n, nb, 32), generator=gen, dtype=torch.int8)
        raw[..., 2:] = q.view(torch.uint8)
    return raw.view(n, nb * BLOCK_BYTES[kind])


def llama_cpp_product(x: torch.Tensor, raw: torch.Tensor, kind: str, k: int) -> torch.Tensor:
    """x quantized per block of 32 (scale amax / 127, round to nearest even), each block's dot
    product with the weights' quants in integers, scales applied in float64."""
    n, nb = raw.shape[0], k // BLOCK
    blocks = raw.view(n, nb, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].double()
    xb = x.float().view(x.shape[0], nb, BLOCK)  # quantized in fp32, as the kernel does (ties are rare, not absent)
    amax = xb.abs().amax(-1)
    dx = (amax / 127).double()
    # a tensor / tensor division (correctly rounded, as C's 127.f / amax); torch's scalar / tensor
    # multiplies by a reciprocal, one ulp off, which moves values at a rounding tie
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    qx = torch.round(xb * inv[..., None]).double()
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).double()
        return torch.einsum("mbk,nbk,nb,mb->mn", qx, q, d, dx)
    qs = blocks[..., (4 if kind == "Q4_1" else 2):][..., :16]
    q = torch.cat([qs & 15, qs >> 4], -1).double()
    y = torch.einsum("mbk,nbk,nb,mb->mn", qx, q, d, dx)
    offset = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].double() if kind == "Q4_1" else -8 * d
    return y + torch.einsum("nb,mb->mn", offset, dx * qx.sum(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_packing_keeps_every_weight(kind):
    gen = torch.Generator().manual_seed(1)
    raw = random_blocks(kind, 37, 96, gen)  # 37 rows: the last panel is partly padding
    packed = pack_blocks(raw, kind, 96)
    assert packed.shape == (3, 3, {"Q4_0": 288, "Q4_1": 320, "Q8_0": 576}[kind])
    # the same bytes per weight as the file (Q8_0: + one int16 sum per block and column)
    want = dequantize_blocks(raw, kind, 96)
    assert torch.equal(unpack_blocks(packed, kind, 37), want)
    c = torch.empty(37, 96)
    native.library().pdserve_gguf_dequantize(packed.data_ptr(), ["Q4_0", "Q4_1", "Q8_0"].index(kind), c.data_ptr(), 37, 96)
    assert torch.equal(c, want)


def test_dequantization_follows_the_block_definitions():
    # one hand-made Q4_1 block: d = 0.5, m = -1, quants 0..15 then 15..0
    raw = torch.zeros(1, 20, dtype=torch.uint8)
    raw[0, 0:2] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)
    raw[0, 2:4] = torch.tensor([-1.0], dtype=torch.float16).view(torch.uint8)
    lo, hi = torch.arange(16), torch.arange(15, -1, -1)
    raw[0, 4:20] = (lo | (hi << 4)).to(torch.uint8)
    w = dequantize_blocks(raw, "Q4_1", 32)
    assert torch.equal(w[0], torch.cat([lo, hi]).float() * 0.5 - 1)


@pytest.fixture(params=cpu_isa.available())
def level(request):
    previous = cpu_isa.force(request.param)
    yield request.param
    cpu_isa.force(previous)


@pytest.mark.parametrize("kind", KINDS)
def test_every_level_computes_llama_cpp_s_product(level, kind):
    gen = torch.Generator().manual_seed(2)
    k = 192
    raw = random_blocks(kind, 50, k, gen)
    layer = GGUFLinear(raw, kind, k)
    for rows in (1, 3, 8, 9, 33):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        want = llama_cpp_product(x.float(), raw, kind, k)
        got = layer(x, out_dtype=torch.float32)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=lambda m: f"{level} {kind} {rows} rows: {m}")
        assert torch.equal(layer(x), got.to(torch.bfloat16))


def test_a_bias_and_fp32_activations_and_empty_batches():
    gen = torch.Generator().manual_seed(3)
    raw = random_blocks("Q4_1", 20, 64, gen)
    bias = torch.randn(20, generator=gen)
    layer = GGUFLinear(raw, "Q4_1", 64, bias)
    x = torch.randn(4, 64, generator=gen)
    want = llama_cpp_product(x, raw, "Q4_1", 64) + bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-4)
    assert layer(torch.empty(0, 64)).shape == (0, 20)


def test_formats_it_cannot_serve_are_clear_errors():
    with pytest.raises(ValueError, match="Q6_K is not served directly"):
        pack_blocks(torch.zeros(2, 210, dtype=torch.uint8), "Q6_K", 256)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        pack_blocks(torch.zeros(2, 20, dtype=torch.uint8), "Q4_1", 33)
    with pytest.raises(ValueError, match="are 40 bytes"):
        pack_blocks(torch.zeros(2, 20, dtype=torch.uint8), "Q4_1", 64)
