"""What a CUDA graph computes, checked where no graph can run: the graph runner's
padded static-buffer forward equals the eager runner, row for row, and the
padding rows leave the KV cache untouched.

On CPU this runs the Triton kernels in the interpreter (dummy:tiny, fp32), so
the padding conventions (slot -1, context 1 over the null block, zero-padded
block-table columns) are checked against the real kernels. On CUDA it runs them
natively; replay itself is tests/kernels/test_cuda_graph_replay.py.
"""

from __future__ import annotations

import torch

from services.config import EngineConfig
from services.engine.cuda_graph import CudaGraphRunner
from services.engine.engine import Engine
from services.engine.kv_cache import KVCacheSpec
from services.engine.model_config import preset_config
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.engine.checks import assert_no_leaks, drain
from tests.kernels.conftest import DEVICE

BLOCK_SIZE = 4


def _tiny_triton_engine(loras: dict | None = None) -> Engine:
    cfg = preset_config("tiny")
    block = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, "float32").block_bytes
    return Engine(EngineConfig(model="dummy:tiny", dtype="fp32", device=DEVICE, kernels="triton",
                               block_size=BLOCK_SIZE, kv_cache_bytes=128 * block, long_prefill_chunk=6,
                               enforce_eager=True, loras=loras or {}))


@torch.inference_mode()
def test_padded_static_forward_equals_the_eager_runner():
    engine = _tiny_triton_engine()
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        # distinct prompts: one sharing a's first block would wait for a to cache it
        for rid, first, n in (("a", 20, 5), ("b", 30, 6), ("c", 50, 3)):
            engine.add_request(rid, [first + i for i in range(n)], params)
        engine.add_request("long", [40 + i for i in range(14)], params)
        engine.step()  # prompts a, b, c whole; "long" a 6-token chunk (long_prefill_chunk)
        long = engine.requests["long"]
        assert long.num_computed_tokens == 6 and not long.output_token_ids
        # Three real rows: decodes of a and b, and one more prompt token of "long",
        # a one-token step that does not sample. They pad up to a batch of 4.
        sched = engine.scheduler.schedule()
        rows = [s for s in sched.scheduled if s.request.request_id in ("a", "b")]
        assert [s.num_new_tokens for s in rows] == [1, 1]
        rows.append(ScheduledRequest(long, 1))
        assert not rows[-1].samples

        graphs = CudaGraphRunner(engine.model, engine.kv_cache, BLOCK_SIZE, max_batch=8,
                                 max_model_len=engine.max_model_len)
        b, w = graphs.plan(rows)
        needed = max(s.request.num_computed_tokens // BLOCK_SIZE + 1 for s in rows)
        assert (b, w) == (4, graphs.widths[0]) and w > needed, "the batch must be padded in rows and columns"

        before = engine.kv_cache.clone()
        eager_sampled, eager_logits = engine.runner.execute(SchedulerOutput(rows))
        eager_kv = engine.kv_cache.clone()
        engine.kv_cache.copy_(before)
        padded_sampled, padded_logits = graphs.run_padded(rows)

        assert [r.request_id for r in padded_sampled] == [r.request_id for r in eager_sampled] == ["a", "b"]
        torch.testing.assert_close(padded_logits, eager_logits, rtol=1e-5, atol=1e-5)
        # The real rows wrote the same K/V, and the padding row wrote nothing.
        torch.testing.assert_close(engine.kv_cache, eager_kv, rtol=1e-6, atol=1e-6)
        changed = (engine.kv_cache != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
        expected = sorted({s.request.block_ids[s.request.num_computed_tokens // BLOCK_SIZE] for s in rows})
        assert changed == expected, "only the real rows' current blocks may change"
    finally:
        drain(engine)
    assert_no_leaks(engine)


@torch.inference_mode()
def test_padded_static_forward_with_adapters_equals_the_eager_runner(tmp_path):
    """A LoRA graph's forward: two adapters and the base model in one padded batch, each row through its
    own adapter slot (the static lora_rows), equal to the eager runner's gathered LoRA step."""
    from tests.engine.lora_adapters import make_adapter

    plain = _tiny_triton_engine()
    loras = {n: str(make_adapter(plain.model, tmp_path / n, seed=i + 1, r=8, scale=0.3)) for i, n in enumerate("ab")}
    drain(plain)
    engine = _tiny_triton_engine(loras)
    try:
        for rid, first, lora in (("a", 20, "a"), ("base", 30, None), ("b", 50, "b")):
            engine.add_request(rid, [first + i for i in range(5)],
                               SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, lora=lora))
        engine.step()  # the three prompts
        rows = engine.scheduler.schedule().scheduled
        assert sorted(s.request.request_id for s in rows) == ["a", "b", "base"]
        assert all(s.num_new_tokens == 1 for s in rows)
        assert sorted(s.request.lora_slot for s in rows)[0] == -1 and len({s.request.lora_slot for s in rows}) == 3

        no_lora = CudaGraphRunner(engine.model, engine.kv_cache, BLOCK_SIZE, max_batch=8,
                                  max_model_len=engine.max_model_len)
        assert no_lora.run_padded(rows) is None, "without LoRA graphs a batch with an adapter runs eagerly"
        graphs = CudaGraphRunner(engine.model, engine.kv_cache, BLOCK_SIZE, max_batch=8,
                                 max_model_len=engine.max_model_len, lora_slots=engine.loras)
        assert graphs.plan(rows)[0] == 4, "three rows pad to a batch of 4"

        before = engine.kv_cache.clone()
        eager_sampled, eager_logits = engine.runner.execute(SchedulerOutput(rows))
        eager_kv = engine.kv_cache.clone()
        engine.kv_cache.copy_(before)
        padded_sampled, padded_logits = graphs.run_padded(rows)
        assert [r.request_id for r in padded_sampled] == [r.request_id for r in eager_sampled]
        torch.testing.assert_close(padded_logits, eager_logits, rtol=1e-5, atol=1e-5)
        # fp32 rounding, not a wrong row: the graph's split-K shrink adds its column blocks into u in another
        # order than the eager step (2e-6 seen on an AMD EPYC); a row through the wrong slot differs by its adapter's delta
        torch.testing.assert_close(engine.kv_cache, eager_kv, rtol=1e-5, atol=1e-5)
        # and the adapters matter: the same rows on the base model give other logits
        base_rows = graphs.layout.views(graphs._buf, *graphs.plan(rows)).lora_rows
        base_rows.fill_(-1)
        engine.kv_cache.copy_(before)
        base_logits = graphs._logits(graphs._forward(*graphs.plan(rows), lora=True), graphs.plan(rows), len(rows),
                                     len(padded_sampled))
        assert not torch.allclose(base_logits, padded_logits, atol=1e-3)
    finally:
        drain(engine)
    assert_no_leaks(engine)
