"""``--kv-cache-dtype int8``: 1.88x the blocks in the same memory, greedy text the same as the
torch reference over the same int8 cache, perplexity next to bf16's, prefix caching intact."""

from __future__ import annotations

import pytest

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from tests.engine.recording import Recorder, run_to_completion
from tests.kernels.greedy_match import assert_same_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "In 1969, Neil Armstrong became the first person to"]
BUDGET = 32 << 20


def _greedy(engine: Engine, n: int = 16):
    rec = Recorder(engine)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"k{i}", engine.tokenizer.encode(p), SamplingParams(max_tokens=n, temperature=0,
                                                                              ignore_eos=True))
    outs = run_to_completion(engine)
    return {rid: [t for o in v for t in o.new_token_ids] for rid, v in outs.items()}, rec.logits


@pytest.mark.slow
def test_int8_cache_holds_more_and_matches_its_reference():
    bf16 = Engine(EngineConfig(kv_cache_bytes=BUDGET))
    int8 = Engine(EngineConfig(kv_cache_dtype="int8", kv_cache_bytes=BUDGET))
    assert int8.kv_cache.dtype.itemsize == 1 and int8.kv_cache.shape[-1] == 64 + 4
    assert int8.block_pool.num_blocks >= 1.88 * bf16.block_pool.num_blocks - 1
    assert "int8 KV" in int8.describe() and int8.namespace.endswith("|kv-int8")
    got, got_logits = _greedy(int8)
    reference = Engine(EngineConfig(kv_cache_dtype="int8", kernels="torch", kv_cache_bytes=BUDGET))
    want, want_logits = _greedy(reference)
    assert_same_greedy(got, want, want_logits, got_logits, "bfloat16")
    assert int8.block_pool.num_used == 0


@pytest.mark.slow
def test_prefix_cache_hits_on_an_int8_cache():
    engine = Engine(EngineConfig(kv_cache_dtype="int8", kv_cache_bytes=BUDGET))
    prompt = engine.tokenizer.encode("Opening hours: Monday to Friday from nine until eight. " * 8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("first", prompt, params)
    first = run_to_completion(engine)["first"]
    engine.add_request("second", prompt, params)
    second = run_to_completion(engine)["second"]
    assert second[-1].num_cached_tokens >= len(prompt) - 16  # every full block hit
    assert [t for o in second for t in o.new_token_ids] == [t for o in first for t in o.new_token_ids]


@pytest.mark.slow
def test_int8_cache_perplexity_next_to_bf16():
    from services.engine.perplexity import perplexity, text_tokens

    bf16 = Engine(EngineConfig(kv_cache_bytes=16 << 20))
    ids = text_tokens(bf16.tokenizer, 1024)
    base = perplexity(bf16, ids)
    int8 = perplexity(Engine(EngineConfig(kv_cache_dtype="int8", kv_cache_bytes=16 << 20)), ids)
    assert abs(int8 / base - 1) < 0.01, (base, int8)


@pytest.mark.parametrize("config, message", [
    (dict(kv_cache_dtype="int8", device="cuda"), "not supported on CUDA yet"),
    (dict(kv_cache_dtype="int8", kernels="triton"), "no Triton kernels"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be"),
])
def test_combinations_that_cannot_run_are_clear_errors(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)
