"""The engine on the Triton kernels produces the greedy tokens of the torch references.

One scenario covers the step shapes the engine runs: a prompt prefilled in
chunks, then a step mixing its decode with a prefill chunk of a second prompt
that hits the prefix cache and the one-token tail of a third (a full prefix
hit), then decode-only steps of all three, which finish at different times.

On CPU the Triton kernels run in the interpreter (~1000x slower than native),
so this uses dummy:tiny in fp32 with block size 4 and a handful of tokens. On
CUDA it also runs the default model (SmolLM2-135M) in bf16 and fp32, with CUDA
graphs (decode-only steps replayed) and without.

Equality is ``assert_same_greedy`` (tests/kernels/greedy_match.py).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.kv_cache import KVCacheSpec
from services.engine.model_config import preset_config
from services.engine.sampling_params import SamplingParams
from tests.engine.checks import assert_no_leaks
from tests.engine.recording import Recorder, run_to_completion
from tests.kernels.conftest import DEVICE
from tests.kernels.greedy_match import assert_same_greedy

ON_CUDA = DEVICE == "cuda"


def _config(model: str | None, dtype: str, block_size: int, kernels: str, enforce_eager: bool) -> EngineConfig:
    if model == "dummy:tiny":
        cfg = preset_config("tiny")
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)
        kv_bytes = 128 * spec.block_bytes
    else:
        kv_bytes = 256 << 20
    # Small max_num_seqs and max_model_len keep the number of captured graphs small.
    return EngineConfig(model=model, dtype=dtype, device=DEVICE, kernels=kernels, block_size=block_size,
                        kv_cache_bytes=kv_bytes, long_prefill_chunk=block_size + block_size // 2,
                        max_num_seqs=8, max_model_len=512, enforce_eager=enforce_eager)


def run_scenario(engine: Engine, block_size: int, max_tokens: int):
    """Returns (tokens per request, Recorder) and checks the scenario happened as described."""
    bs = block_size
    a = [100 + (7 * i) % 300 for i in range(2 * bs + 3)]
    prompts = {"a": a, "b": a[: 2 * bs] + [11, 12, 13], "c": a[: 2 * bs] + [5]}
    rec = Recorder(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request("a", prompts["a"], params)
    outs = defaultdict(list)
    while not outs["a"]:
        for o in engine.step():
            outs[o.request_id].append(o)
    engine.add_request("b", prompts["b"], params)
    engine.add_request("c", prompts["c"], SamplingParams(max_tokens=max_tokens - 2, temperature=0, ignore_eos=True))
    for rid, more in run_to_completion(engine).items():
        outs[rid] += more

    assert len([n for n in rec.scheduled["a"] if n > 1]) >= 2, "a's prompt was not prefilled in chunks"
    mixed = [s for s in rec.steps if 1 in s and any(n > 1 for n in s)]
    assert mixed, f"no step mixed decodes with a prefill chunk: {rec.steps}"
    final = {rid: o[-1] for rid, o in outs.items()}
    assert final["b"].num_cached_tokens == 2 * bs and final["c"].num_cached_tokens == 2 * bs
    assert rec.scheduled["c"][0] == 1, "c's prompt tail after the prefix hit is one token"
    assert_no_leaks(engine)
    return {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in prompts}, rec


CASES = [pytest.param("dummy:tiny", "float32", 4, True, id="tiny-fp32")]
if ON_CUDA:
    CASES += [
        pytest.param("dummy:tiny", "float32", 4, False, id="tiny-fp32-graphs"),
        pytest.param(None, "float32", 16, False, id="default-fp32-graphs"),
        pytest.param(None, "bfloat16", 16, False, id="default-bf16-graphs"),
        pytest.param(None, "bfloat16", 16, True, id="default-bf16-eager"),
    ]


@pytest.mark.parametrize("model,dtype,block_size,enforce_eager", CASES)
def test_triton_engine_matches_the_torch_engine(model, dtype, block_size, enforce_eager):
    max_tokens = 6 if model == "dummy:tiny" else 16
    ref_engine = Engine(_config(model, dtype, block_size, "torch", enforce_eager=True))
    ref, ref_rec = run_scenario(ref_engine, block_size, max_tokens)
    del ref_engine
    engine = Engine(_config(model, dtype, block_size, "triton", enforce_eager))
    assert engine.model.ops.name == "triton"
    got, rec = run_scenario(engine, block_size, max_tokens)
    assert rec.steps == ref_rec.steps, "both engines must run the same schedule"
    assert_same_greedy(got, ref, ref_rec.logits, rec.logits, dtype)
    graphs = engine.runner.cuda_graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.num_replays > 0, "no decode step was replayed from a CUDA graph"
