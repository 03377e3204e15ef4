"""Multi-LoRA on a CUDA engine (skipped without a GPU): the Triton gathered kernels (kernels/lora.py)
run a batch of four adapters and the base model, decode steps eager and with CUDA graphs (an engine
started with adapters captures graphs for steps with adapters: services/engine/cuda_graph.py); each
request's greedy tokens equal the fp32 CPU engine's."""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from tests.engine.lora_adapters import make_adapter, run_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton LoRA path needs a GPU")

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _run(engine: Engine, prompts: dict) -> dict[str, list[int]]:
    return run_batch(engine, prompts, GREEDY)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_mixed_adapter_batch_matches_cpu(eager, tmp_path):
    cpu = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=4 << 20))
    loras = {name: str(make_adapter(cpu.model, tmp_path / name, seed=i + 1, r=r, scale=0.3))
             for i, (name, r) in enumerate((("a", 8), ("b", 16), ("c", 8), ("d", 16)))}
    for name, path in loras.items():
        cpu.register_lora(name, path)
    cuda = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", device="cuda", kv_cache_bytes=4 << 20,
                               loras=loras, enforce_eager=eager))
    assert cuda.model.ops.name == "triton"
    g = torch.Generator().manual_seed(0)
    prompts = {n: (torch.randint(2, 512, (9,), generator=g).tolist(), n) for n in loras}
    prompts["base"] = (torch.randint(2, 512, (9,), generator=g).tolist(), None)
    assert _run(cuda, prompts) == _run(cpu, prompts)
    if not eager:  # every decode step of the batch had adapters, and replayed a LoRA graph
        assert cuda.runner.cuda_graphs.num_replays >= GREEDY.max_tokens - 1
