"""CUDA-graph replay equals eager execution. GPU only: skipped where CUDA is absent
(CPU machines check the padded forward the graphs capture instead, in
test_cuda_graph_padding.py, and the bucketing in tests/engine/test_cuda_graph_buckets.py).

- A replayed decode batch gives the logits and KV writes of the same padded
  inputs run eagerly (``run_padded``): capture froze the right computation.
- An engine with graphs generates the greedy tokens of one without
  (``enforce_eager``) over a workload whose decode batches shrink through
  several captured sizes (padding) and whose contexts cross block-table
  width buckets, and every decode-only step, and only those, was replayed.
"""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from tests.engine.checks import assert_no_leaks, drain
from tests.engine.recording import Recorder, run_to_completion
from tests.kernels.greedy_match import assert_same_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

# Prompts straddle 256 tokens (the narrowest captured width at block size 16),
# so some requests move to the next width bucket while decoding.
PROMPT_LENS = [5, 37, 250, 100, 251, 16, 240]
MAX_TOKENS = [24, 3, 20, 9, 12, 17, 30]


def _engine(model: str | None, dtype: str, enforce_eager: bool) -> Engine:
    return Engine(EngineConfig(model=model, dtype=dtype, device="cuda", kernels="triton", kv_cache_bytes=512 << 20,
                               max_num_seqs=16, max_model_len=1024, enforce_eager=enforce_eager))


def _generate(engine: Engine):
    rec = Recorder(engine)
    vocab = engine.model_config.vocab_size
    for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS, strict=True)):
        prompt = [(1000 + 31 * i + 7 * j) % (vocab - 10) + 5 for j in range(n)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    assert_no_leaks(engine)
    return {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}, rec


@pytest.mark.parametrize("model,dtype", [("dummy:tiny", "float32"), (None, "float32"), (None, "bfloat16")],
                         ids=["tiny-fp32", "default-fp32", "default-bf16"])
def test_engine_with_graphs_matches_eager(model, dtype):
    eager = _engine(model, dtype, enforce_eager=True)
    ref, ref_rec = _generate(eager)
    del eager
    engine = _engine(model, dtype, enforce_eager=False)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and graphs.num_graphs == len(graphs.batch_sizes) * len(graphs.widths)
    got, rec = _generate(engine)
    assert rec.steps == ref_rec.steps
    assert_same_greedy(got, ref, ref_rec.logits, rec.logits, dtype)
    decode_only = [s for s in rec.steps if s and all(n == 1 for n in s)]
    assert {len(s) for s in decode_only} >= {7, 5, 3}, "the workload must shrink through padded sizes"
    assert graphs.num_replays == len(decode_only), "every decode-only step, and nothing else, replays a graph"


@torch.inference_mode()
def test_replay_equals_the_same_padded_inputs_run_eagerly():
    engine = _engine("dummy:tiny", "float32", enforce_eager=False)
    graphs = engine.runner.cuda_graphs
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for i, n in enumerate((3, 260, 40)):
            engine.add_request(f"r{i}", [7 + (i + j) % 400 for j in range(n)], params)
        while any(not r.output_token_ids for r in engine.requests.values()):
            engine.step()
        rows = engine.scheduler.schedule().scheduled
        assert graphs.plan(rows) == (4, 32)
        before = engine.kv_cache.clone()
        eager_sampled, eager_logits = graphs.run_padded(rows)
        eager_kv = engine.kv_cache.clone()
        engine.kv_cache.copy_(before)
        replays = graphs.num_replays
        sampled, logits = graphs.execute(rows)
        torch.cuda.synchronize()
        assert graphs.num_replays == replays + 1
        assert [r.request_id for r in sampled] == [r.request_id for r in eager_sampled]
        torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(engine.kv_cache, eager_kv, rtol=1e-5, atol=1e-5)
    finally:
        drain(engine)
    assert_no_leaks(engine)
