"""The fused step driver (kernels/decode_layers_cpu.py) computes exactly what the model's Python
path computes: the same tokens and the same log-probabilities, bit for bit, for every weight format
and KV layout it takes, under continuous batching: decode-only steps, steps with prefill chunks
(whole prompts, a prompt's tail after a prefix-cache hit) and steps that mix both."""

from __future__ import annotations

import pytest

from kernels import native
from kernels.decode_layers_cpu import ENV
from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.model import DecoderLayer
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.level() in (None, "generic", "avx2"),
                                reason="the C kernels need AVX-512 (this CPU or build has none)")

PROMPTS = [list(range(100, 107)), list(range(300, 341)), list(range(500, 519))]


def _generate(engine: Engine, fused: bool, monkeypatch, tag: str) -> tuple[list, int]:
    """Every prompt twice (the second time its full blocks are prefix hits, so only its tail is
    computed, beside the others' decodes); returns the outputs and the steps on the Python path."""
    monkeypatch.setenv(ENV, "1" if fused else "0")
    engine.model._fused_key = None  # built again under the setting
    assert engine.block_pool.reset_prefix_cache()  # each path computes the same prompts from scratch
    python_steps = 0
    layer_forward = DecoderLayer.forward

    def counted(layer, *args):
        nonlocal python_steps
        python_steps += layer.self_attn.layer_idx == 0
        return layer_forward(layer, *args)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    out: dict[str, list] = {}
    for round_ in range(2):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{tag}{round_}-{i}", prompt, params)
            engine.step()  # staggered: later prompts are admitted beside earlier ones' decodes
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id.split("-")[1], []).append((o.new_token_ids, o.logprobs))
    monkeypatch.setattr(DecoderLayer, "forward", layer_forward)
    return [out[str(i)] for i in range(len(PROMPTS))], python_steps


@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, "auto"), ("int8", "auto"), ("gguf", "auto"),
                                                         (None, "int8")], ids=["bf16", "int8", "gguf", "kv-int8"])
def test_fused_layers_match_the_python_path_bit_for_bit(monkeypatch, quantization, kv_cache_dtype):
    engine = Engine(EngineConfig(dtype="bf16", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                 max_num_seqs=4, kv_cache_bytes=64 << 20))
    python_path, python_steps = _generate(engine, False, monkeypatch, "py")
    assert python_steps > 0 and engine.model._fused is None
    assert engine.block_pool.prefix_hits > 0, "the second round should hit the first round's blocks"
    fused, python_steps = _generate(engine, True, monkeypatch, "fused")
    assert python_steps == 0, f"{python_steps} steps (prefill chunks or mixed) left the driver"
    assert fused == python_path
