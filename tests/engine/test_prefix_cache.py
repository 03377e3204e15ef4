"""A second request that shares a 256+ token prefix with a finished one computes only its suffix; a repeated
prompt computes one token."""

from __future__ import annotations

import pytest

from services.config import EngineConfig
from services.engine.block_hash import hash_prompt_blocks
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from tests.engine.recording import Recorder, run_to_completion

pytestmark = pytest.mark.slow

PREFIX = "Rules of the house. " + " ".join(f"Rule {i}: keep the door at number {i * 7} closed." for i in range(40))


def _generate(engine: Engine, rid: str, ids: list[int]) -> list:
    engine.add_request(rid, ids, SamplingParams(max_tokens=12, temperature=0))
    return run_to_completion(engine)[rid]


def test_shared_prefix_computes_only_the_suffix():
    engine = Engine(EngineConfig(dtype="fp32"))
    rec = Recorder(engine)
    tok = engine.tokenizer
    first = tok.encode(PREFIX + " Question: which door is number 14? Answer:")
    second = tok.encode(PREFIX + " Question: how many rules are there? Answer:")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 256

    _generate(engine, "first", first)
    hits_before = engine.block_pool.prefix_hits
    outs = _generate(engine, "second", second)

    bs = engine.config.block_size
    cached = outs[-1].num_cached_tokens
    # the full blocks hit; the shared tokens after them are computed again (the tail copy is for a prompt
    # whose every full block hits: KVManager._copy_tail)
    assert cached == (shared // bs) * bs >= 256
    # the prompt pass of the second request ran only the uncached tail
    prompt_steps = rec.scheduled["second"][: len(rec.scheduled["second"]) - (len(outs) - 1)]
    assert sum(prompt_steps) == len(second) - cached
    assert engine.block_pool.prefix_hits - hits_before == cached // bs
    assert engine.block_pool.num_used == 0

    # and the answer is what a cold engine gives
    cold = Engine(EngineConfig(dtype="fp32", enable_prefix_caching=False))
    cold_outs = _generate(cold, "second", second)
    assert [t for o in outs for t in o.new_token_ids] == [t for o in cold_outs for t in o.new_token_ids]
    assert cold_outs[-1].num_cached_tokens == 0


def test_kv_events_describe_the_cache():
    engine = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=64 * 1024))
    ids = list(range(10, 10 + 40))  # 2 full blocks of 16 + 8
    engine.add_request("a", ids, SamplingParams(max_tokens=1, temperature=0))
    run_to_completion(engine)
    assert engine.has_kv_events()  # what a worker asks before draining them (no engine-thread hop when not)
    events = engine.take_kv_events()
    stored = [h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    from services.engine.block_hash import hash_prompt_blocks

    assert stored == hash_prompt_blocks(ids, 16, engine.namespace)
    assert engine.take_kv_events() == [] and not engine.has_kv_events()  # drained
    # filling the cache with other prompts evicts them, and says so
    for i in range(12):
        engine.add_request(f"f{i}", list(range(200 + i, 200 + i + 40)), SamplingParams(max_tokens=1))
        run_to_completion(engine)
    removed = {h for e in engine.take_kv_events() if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}
    assert set(stored) <= removed


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_repeated_prompt_computes_only_its_last_token():
    """Its full blocks hit, and the partial last block the first request left behind is taken over:
    one token is computed (a decode step's work), and the answer is the one computed from scratch."""
    engine = Engine(EngineConfig(dtype="bf16", kv_cache_bytes=64 << 20))
    rec = Recorder(engine)
    bs = engine.config.block_size
    ids = engine.tokenizer.encode(PREFIX)
    ids = ids[: (len(ids) // bs - 1) * bs + 11]  # 10 tokens past the last full block, then the last one
    first = _generate(engine, "first", ids)
    again = _generate(engine, "again", ids)
    assert rec.scheduled["again"][0] == 1
    assert again[-1].num_cached_tokens == len(ids) - 1
    assert _tokens(again) == _tokens(first)

    # the same prompt with its rest changed from the 6th token on takes the block's first 5 tokens
    changed = ids[:-6] + [t + 1 for t in ids[-6:]]
    cold = Engine(EngineConfig(dtype="bf16", kv_cache_bytes=64 << 20, enable_prefix_caching=False))
    expected = _generate(cold, "changed", changed)
    outs = _generate(engine, "changed", changed)
    assert rec.scheduled["changed"][0] == 6 and _tokens(outs) == _tokens(expected)

    # a tail the pool has handed out since holds other KV: it is not copied
    pool = engine.block_pool
    tail = pool.tails[hash_prompt_blocks(ids, bs, engine.namespace)[-1]]  # after the last full block
    pool._free.move_to_end(tail, last=False)  # next to go
    assert pool.allocate(1) == [tail]
    engine.kv_cache[tail] = 0  # its new holder's KV
    pool.free([tail])
    outs = _generate(engine, "after", ids)
    assert rec.scheduled["after"][0] == 11 and _tokens(outs) == _tokens(first)
    assert pool.num_used == 0
