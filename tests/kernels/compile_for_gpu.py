"""Compile every Triton kernel for an NVIDIA GPU on a machine that has none.

Run as a script (``python tests/kernels/compile_for_gpu.py 90``); the test in
test_triton_compiles_for_gpu.py does so in a subprocess, because it swaps
triton's active driver and stubs the wrappers' device check for the whole
process. The interpreter tests check the numbers; this checks what the
interpreter cannot: that each kernel as launched (same wrappers, same
constexprs, same specialisations, e.g. ``num_seqs == 1``) passes triton's
compiler down to a cubin for the target, and that its shared memory fits.

It drives triton's own JIT path (``JITFunction.warmup``) with a stand-in for
the CUDA driver that answers only "which device, stream and target": that is
the part of triton's internals this leans on (checked against triton 3.7).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402

import kernels.activation  # noqa: E402
import kernels.kv_write  # noqa: E402
import kernels.lora  # noqa: E402
import kernels.paged_attention  # noqa: E402
import kernels.rmsnorm  # noqa: E402
import kernels.rotary  # noqa: E402
import kernels.triton_jit  # noqa: E402
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache, dtype_name, layer_view  # noqa: E402

# Per-block shared memory limits (opt-in maximum), bytes.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


class CompileOnlyDriver(CudaDriver):
    """Answers what triton's JIT asks before compiling; loads no CUDA library."""

    def __init__(self, capability: int) -> None:
        self.capability = capability

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.capability, 32)


def _record_compiles(results: list) -> None:
    def getitem(self, grid):
        if self._jitted is None:
            self._jitted = triton.jit(self.fn)

        def compile_only(*args, **kwargs):
            compiled = self._jitted.warmup(*args, grid=grid, **kwargs)
            results.append((self.fn.__name__, args, kwargs, compiled.metadata.shared))

        return compile_only

    kernels.triton_jit.LazyKernel.__getitem__ = getitem
    # CPU tensors stand in for CUDA ones: the compiler sees only dtypes, strides
    # and alignment.
    for module in (kernels.activation, kernels.kv_write, kernels.lora, kernels.paged_attention, kernels.rmsnorm,
                   kernels.rotary):
        module.check_launchable = lambda *tensors: None


def _launch_everything(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """Calls each wrapper once per kernel variant the engine can launch."""
    t = 4
    kernels.activation.silu_and_mul(torch.randn(t, 2 * 1536).to(dtype))
    x, w = torch.randn(t, num_heads * head_dim).to(dtype), torch.randn(num_heads * head_dim).to(dtype)
    kernels.rmsnorm.rms_norm(x, w, 1e-5)
    kernels.rmsnorm.rms_norm(x, w, 1e-5, x.clone())
    q = torch.randn(t, num_heads, head_dim).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim).to(dtype)
    kernels.rotary.rotary(q, k, torch.arange(t), torch.randn(64, head_dim))
    hidden, qkv = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
    for rank in (16, 64):  # batched LoRA on the fused qkv projection (3 segments)
        bounds = (0, hidden, hidden + num_kv_heads * head_dim, qkv)
        kernels.lora.lora_apply(torch.randn(t, qkv).to(dtype), x, torch.randn(2, 3 * rank, hidden).to(dtype),
                                torch.randn(2, rank, qkv).to(dtype), bounds, torch.tensor([0, -1, 1, 0]))

    spec = KVCacheSpec(num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                       dtype=dtype_name(dtype))
    k_cache, v_cache = layer_view(allocate_kv_cache(spec, 8), 1)
    kernels.kv_write.write_kv(k, k, k_cache, v_cache, torch.arange(t))

    attn = kernels.paged_attention
    lens = torch.tensor([40, 20], dtype=torch.int32)
    long_table = torch.ones(2, 64, dtype=torch.int32)  # 1024 positions: split-K and reduce
    short_table = torch.ones(2, 4, dtype=torch.int32)  # 64 positions: one split
    for table in (long_table, short_table):
        attn.paged_decode_attention(q[:2], k_cache, v_cache, table, lens, 0.125)
    for cu in ([0, 4], [0, 1, 4]):  # one sequence (num_seqs specialised to 1) and several
        n = len(cu) - 1
        attn.paged_prefill_attention(q, k_cache, v_cache, short_table[:n], torch.tensor(cu, dtype=torch.int32),
                                     lens[:n], 0.125)


def main(capability: int) -> None:
    triton.runtime.driver.set_active(CompileOnlyDriver(capability))
    results: list = []
    _record_compiles(results)
    # Every constexpr branch, in 16-bit and in fp32 (IEEE dots); head_dim 128
    # in 16-bit has the largest tiles. (fp32 at head_dim 128 halves its tiles:
    # 53 KB of shared memory on sm_90; left out because fp32 dots compile slowly.)
    _launch_everything(torch.bfloat16, head_dim=64, num_heads=9, num_kv_heads=3)  # SmolLM2-135M
    _launch_everything(torch.float32, head_dim=64, num_heads=9, num_kv_heads=3)
    _launch_everything(torch.bfloat16, head_dim=128, num_heads=32, num_kv_heads=8)  # Llama-3-8B
    limit = SHARED_LIMIT.get(capability)
    for name, _, kwargs, shared in results:
        constexprs = {k: v for k, v in kwargs.items() if k.isupper()}
        print(f"sm_{capability} {name} shared={shared} {constexprs}")
        if limit is not None and shared > limit:
            raise SystemExit(f"{name} {constexprs} needs {shared} bytes of shared memory; sm_{capability} has {limit}")
    print(f"compiled {len(results)} kernel launches for sm_{capability}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
