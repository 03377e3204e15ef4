"""``--quantization int8``: the engine's int8 kernels compute what the dequantized weights do,
the quantized weights are cached and reused, perplexity stays close to bf16, and combinations
that cannot run are clear errors."""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from tests.engine.recording import Recorder, run_to_completion
from tests.kernels.greedy_match import assert_same_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "In 1969, Neil Armstrong became the first person to"]


def _greedy(engine: Engine, n: int = 16):
    rec = Recorder(engine)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"q{i}", engine.tokenizer.encode(p), SamplingParams(max_tokens=n, temperature=0,
                                                                              ignore_eos=True))
    outs = run_to_completion(engine)
    return {rid: [t for o in v for t in o.new_token_ids] for rid, v in outs.items()}, rec.logits


@pytest.mark.slow
def test_int8_kernels_match_the_dequantized_reference_and_reuse_the_cache(monkeypatch):
    import services.engine.quantize as quantize

    kernel = Engine(EngineConfig(quantization="int8", kv_cache_bytes=64 << 20))
    assert "int8 weights" in kernel.describe() and kernel.namespace.endswith("|int8")
    qkv = kernel.model.layers[0].self_attn.qkv_proj
    assert qkv.packed.dtype == torch.int8 and qkv.scale.shape == (qkv.out_features,)
    assert kernel.model.logits_proj.packed.dtype == torch.int8  # the output projection too
    # a second engine reads the cached weights instead of quantizing again
    monkeypatch.setattr(quantize, "_from_checkpoint", lambda *a: pytest.fail("quantized twice"))
    reference = Engine(EngineConfig(quantization="int8", kernels="torch", kv_cache_bytes=64 << 20))
    # the torch path holds the same int8 weights dequantized in plain projections
    ref_w = reference.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(ref_w, qkv.unpacked_weight(torch.bfloat16))
    got, got_logits = _greedy(kernel)
    want, want_logits = _greedy(reference)
    assert_same_greedy(got, want, want_logits, got_logits, "bfloat16")


@pytest.mark.slow
def test_int8_perplexity_within_one_percent_of_bf16():
    from services.engine.perplexity import perplexity, text_tokens

    bf16 = Engine(EngineConfig(kv_cache_bytes=16 << 20))
    ids = text_tokens(bf16.tokenizer, 1024)  # the bench uses 4096; 1024 keeps the test short
    base = perplexity(bf16, ids)
    int8 = perplexity(Engine(EngineConfig(quantization="int8", kv_cache_bytes=16 << 20)), ids)
    assert 1 < base < 100
    assert abs(int8 / base - 1) < 0.01, (base, int8)


def test_dummy_models_quantize_their_own_weights(one_thread):
    engine = Engine(EngineConfig(model="dummy:tiny", quantization="int8", kv_cache_bytes=1 << 20))
    got, _ = _greedy_ids(engine)
    reference = Engine(EngineConfig(model="dummy:tiny", quantization="int8", kernels="torch", kv_cache_bytes=1 << 20))
    want, _ = _greedy_ids(reference)
    assert got == want


def _greedy_ids(engine: Engine):
    engine.add_request("t", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    return [t for o in outs["t"] for t in o.new_token_ids], None


@pytest.mark.parametrize("config, message", [
    (dict(quantization="int8", device="cuda"), "not supported on CUDA yet"),
    (dict(quantization="int4"), "quantization must be"),
])
def test_combinations_that_cannot_run_are_clear_errors(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)
