"""The spill tier of a CUDA engine: pinned host slots, copies on a side stream.

The CPU tests (test_spill_tier.py) cover the bookkeeping; these run the CUDA copy paths of
``services/engine/kv_spill.py``, which only a GPU can: an evicted prefix is restored from pinned
host memory (or a mapped file) and the greedy output equals a cold engine's, token for token.
"""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.kv_spill import slot_bytes
from services.engine.sampling_params import SamplingParams
from tests.engine.checks import run, tokens
from tests.engine.conftest import TINY_BLOCK_BYTES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA spill path needs a GPU")

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _prompt(seed: int, n: int = 80) -> list[int]:
    return [(seed * 7919 + i * 131) % 500 + 2 for i in range(n)]  # 5 full blocks of 16


def _engine(**config) -> Engine:
    return Engine(EngineConfig(model="dummy:tiny", dtype="fp32", device="cuda", **config))


@pytest.mark.parametrize("in_file", [False, True], ids=["pinned", "file"])
def test_cuda_engine_restores_an_evicted_prefix_exactly(in_file, tmp_path):
    small = _engine(kv_cache_bytes=16 * TINY_BLOCK_BYTES)
    spill = 64 * slot_bytes(small.kv_spec, "auto")
    engine = _engine(kv_cache_bytes=16 * TINY_BLOCK_BYTES, kv_spill_bytes=spill, kv_spill_dtype="auto",
                     kv_spill_dir=str(tmp_path) if in_file else None)
    cold = _engine(kv_cache_bytes=64 * TINY_BLOCK_BYTES)
    first = {}
    for s in range(4):  # 4 x 5 blocks through a 15-block pool: the first prompts are evicted
        engine.add_request(f"p{s}", _prompt(s), GREEDY)
        first[s] = tokens(run(engine)[f"p{s}"])
    before = engine.stats()
    assert before["kv_spill_blocks"] > 0
    engine.add_request("again", _prompt(0), GREEDY)
    outs = run(engine)["again"]
    assert outs[-1].num_cached_tokens == 64
    assert engine.stats()["kv_restored_blocks"] - before["kv_restored_blocks"] == 4
    cold.add_request("ref", _prompt(0), GREEDY)
    assert tokens(outs) == tokens(run(cold)["ref"]) == first[0]
