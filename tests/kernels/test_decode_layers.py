"""The fused decode driver (kernels/decode_layers_cpu.py) computes exactly what the model's Python
path computes: the same tokens and the same log-probabilities, bit for bit, for every weight format
and KV layout it takes, under continuous batching (steps with a prefill chunk stay on the Python
path, decode-only steps take the driver)."""

from __future__ import annotations

import pytest

from kernels import native
from kernels.decode_layers_cpu import ENV
from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.level() in (None, "generic", "avx2"),
                                reason="the C kernels need AVX-512 (this CPU or build has none)")

PROMPTS = [list(range(100, 107)), list(range(300, 341)), list(range(500, 519))]


def _generate(engine: Engine, fused: bool, monkeypatch, tag: str) -> tuple[list, bool]:
    monkeypatch.setenv(ENV, "1" if fused else "0")
    engine.model._fused_key = None  # built again under the setting
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", prompt, params)
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id.split("-")[1], []).append((o.new_token_ids, o.logprobs))
    return [out[str(i)] for i in range(len(PROMPTS))], engine.model._fused is not None


@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, "auto"), ("int8", "auto"), ("gguf", "auto"),
                                                         (None, "int8")], ids=["bf16", "int8", "gguf", "kv-int8"])
def test_fused_decode_layers_match_the_python_path_bit_for_bit(monkeypatch, quantization, kv_cache_dtype):
    engine = Engine(EngineConfig(dtype="bf16", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                 max_num_seqs=4, kv_cache_bytes=64 << 20, enable_prefix_caching=False))
    python_path, used = _generate(engine, False, monkeypatch, "py")
    assert not used
    fused, used = _generate(engine, True, monkeypatch, "fused")
    assert used, "the driver did not take this model"
    assert fused == python_path
