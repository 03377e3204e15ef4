"""The KV spill tier: evicted prefix blocks kept and restored instead of recomputed.

Every test ends with the leak check (tests/conftest.py -> checks.assert_no_leaks), which with
a spill tier also checks that every slot is held, free or pinned exactly once, that no restore
is in flight and that no block is cached in both tiers.
"""

from __future__ import annotations

import os
import threading

import pytest

from services.config import EngineConfig
from services.engine.block_hash import hash_prompt_blocks
from services.engine.block_pool import SPILL, BlockRemoved, BlockStored
from services.engine.kv_spill import slot_bytes
from services.engine.sampling_params import SamplingParams
from services.engine.spill_tier import SpillTier
from tests.engine.checks import run, tokens

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _prompt(seed: int, n: int = 80) -> list[int]:
    return [(seed * 7919 + i * 131) % 500 + 2 for i in range(n)]  # 5 full blocks of 16


def _spill_engine(tiny_engine, slots: int = 64, dtype: str = "auto", **config):
    probe = tiny_engine(num_blocks=16)
    spill = slots * slot_bytes(probe.kv_spec, dtype)
    return tiny_engine(num_blocks=16, kv_spill_bytes=spill, kv_spill_dtype=dtype, **config)


def _fill(engine, seeds) -> dict[str, list[int]]:
    """Each prompt alone (so the 15-block pool evicts the previous ones); their greedy tokens."""
    out = {}
    for s in seeds:
        engine.add_request(f"p{s}", _prompt(s), GREEDY)
        out[s] = tokens(run(engine)[f"p{s}"])
    return out


# ---- bookkeeping -------------------------------------------------------------
class _NoBytes:
    num_slots = 3

    def write(self, blocks, slots):
        pass

    def restore(self, slots, blocks):
        raise AssertionError("not used here")


def test_full_tier_drops_its_least_recently_spilled_block_and_verifies_tokens():
    tier = SpillTier(_NoBytes(), block_size=2)
    slots, dropped = tier.admit([1, 2, 3], [(1, 1), (2, 2), (3, 3)])
    assert sorted(slots) == [0, 1, 2] and dropped == []
    slots, dropped = tier.admit([4], [(4, 4)])
    assert dropped == [1] and 1 not in tier and 4 in tier
    # a hash hit whose stored tokens differ is a miss (a collision never restores wrong KV)
    assert tier.match([2, 3], [2, 2, 3, 3], 0) == 2
    assert tier.match([2, 3], [2, 2, 9, 9], 0) == 1
    taken = tier.take([2])
    assert 2 not in tier and tier.num_pinned == 1
    # a pinned slot is never reused, even when the tier must drop blocks for room
    slots, dropped = tier.admit([5, 6], [(5, 5), (6, 6)])
    assert taken[0] not in slots
    tier.release(taken)
    tier.check()
    assert tier.num_pinned == 0


# ---- spill and restore in an engine ----------------------------------------------
def test_evicted_prefix_is_restored_not_recomputed_and_lossless_mode_is_exact(tiny_engine):
    engine = _spill_engine(tiny_engine, dtype="auto")
    cold = tiny_engine(num_blocks=64)  # same weights (seed), no tier: the reference
    first = _fill(engine, range(4))  # 4 x 5 blocks through a 15-block pool: the first ones are evicted
    stats = engine.stats()
    assert stats["kv_spill_blocks"] > 0 and stats["kv_spill_dropped_blocks"] == 0
    engine.add_request("again", _prompt(0), GREEDY)
    outs = run(engine)["again"]
    # 4 full blocks may hit (the one holding the last token is always computed)
    assert outs[-1].num_cached_tokens == 64
    assert engine.stats()["kv_restored_blocks"] - stats["kv_restored_blocks"] == 4
    cold.add_request("ref", _prompt(0), GREEDY)
    assert tokens(outs) == tokens(run(cold)["ref"]) == first[0]


def test_int8_tier_holds_more_blocks_and_restores(tiny_engine):
    lossless = _spill_engine(tiny_engine, slots=64, dtype="auto")
    int8 = tiny_engine(num_blocks=16, kv_spill_bytes=lossless.block_pool.spill.storage.slot_bytes * 64,
                       kv_spill_dtype="int8")
    assert int8.block_pool.spill.num_slots > 1.5 * lossless.block_pool.spill.num_slots
    _fill(int8, range(4))
    int8.add_request("again", _prompt(0), GREEDY)
    outs = run(int8)["again"]
    assert outs[-1].num_cached_tokens == 64 and len(tokens(outs)) == 4


def test_int8_slots_hold_the_int8_cache_rows_bytes_and_restore_within_their_rounding():
    """The store's per-block quantization writes exactly kernels/kv_int8.quantize_rows' bytes."""
    import torch

    from kernels.kv_int8 import dequantize_rows, quantize_rows
    from services.engine.kv_cache import KVCacheSpec
    from services.engine.kv_spill import SpillStore

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
    kv = torch.randn(spec.shape(6)).to(torch.bfloat16)
    kv[3, 0, 0, 0] = 0  # an all-zero row keeps scale 1
    store = SpillStore(spec, kv, 8 * slot_bytes(spec, "int8"), "int8")
    store.write([1, 3, 5], [4, 0, 7])
    assert torch.equal(store.slots[[4, 0, 7]], quantize_rows(kv[[1, 3, 5]]))
    want = dequantize_rows(quantize_rows(kv[[3, 1]]), torch.bfloat16)
    store.restore([0, 4], [2, 4]).result()
    assert torch.equal(kv[[2, 4]], want)


def test_events_say_which_tier_holds_a_block(tiny_engine):
    engine = _spill_engine(tiny_engine, slots=3)
    _fill(engine, range(4))
    events = engine.take_kv_events()
    first = hash_prompt_blocks(_prompt(0), 16, engine.namespace)
    spilled = {h for e in events if isinstance(e, BlockStored) and e.tier == SPILL for h in e.block_hashes}
    dropped = {h for e in events if isinstance(e, BlockRemoved) and e.tier == SPILL for h in e.block_hashes}
    assert set(first) <= spilled  # the first prompt's blocks went to the spill tier...
    assert dropped and dropped <= spilled  # ...and a 3-slot tier dropped the oldest of them again
    assert len(engine.spilled_block_hashes()) == 3
    assert not set(engine.spilled_block_hashes()) & set(engine.cached_block_hashes())


def test_recomputed_block_leaves_the_spill_tier(tiny_engine):
    """A hash cached in the pool again is taken out of the spill tier: one tier per block."""
    engine = _spill_engine(tiny_engine)
    _fill(engine, range(4))
    first = hash_prompt_blocks(_prompt(0), 16, engine.namespace)
    assert all(h in engine.block_pool.spill for h in first)
    engine.add_request("again", _prompt(0), GREEDY)
    run(engine)
    assert not any(h in engine.block_pool.spill for h in first[:4])
    assert all(h in engine.block_pool.cached for h in first[:4])


def test_other_requests_step_while_a_restore_copies_and_an_abort_waits_for_it(tiny_engine):
    engine = _spill_engine(tiny_engine)
    _fill(engine, range(4))
    store = engine.block_pool.spill.storage
    gate = threading.Event()
    copy_back = store._copy_back
    store._copy_back = lambda src, dst: (gate.wait(10), copy_back(src, dst))[1]
    engine.add_request("busy", _prompt(9, 20), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.add_request("restoring", _prompt(0), GREEDY)
    steps_while_restoring = 0
    for _ in range(8):
        for out in engine.step():
            if out.request_id == "busy" and out.new_token_ids:
                steps_while_restoring += 1
        assert engine.kv.num_restoring == 1  # still copying: the request waits, holding its blocks
    assert steps_while_restoring >= 6  # the other request decoded meanwhile
    threading.Timer(0.2, gate.set).start()
    engine.abort("restoring")  # waits for the copy (it writes into the blocks), then frees them
    assert engine.kv.num_restoring == 0 and engine.block_pool.spill.num_pinned == 0
    run(engine)
    # the copy finished before the abort freed the blocks, so they are cached: a pool hit now
    engine.add_request("hit", _prompt(0), GREEDY)
    hits = engine.block_pool.prefix_hits
    run(engine)
    assert engine.block_pool.prefix_hits - hits == 4


def test_a_failed_restore_computes_the_blocks_instead(tiny_engine):
    engine = _spill_engine(tiny_engine)
    first = _fill(engine, range(4))
    store = engine.block_pool.spill.storage

    def broken(src, dst):
        raise RuntimeError("disk gone")

    store._copy_back = broken
    engine.add_request("again", _prompt(0), GREEDY)
    outs = run(engine)["again"]
    assert outs[-1].num_cached_tokens == 0 and tokens(outs) == first[0]
    assert engine.stats()["kv_restored_blocks"] == 0


def test_file_tier_leaves_no_file_and_restores(tiny_engine, tmp_path):
    engine = _spill_engine(tiny_engine, kv_spill_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # mapped, then unlinked at once
    first = _fill(engine, range(4))
    engine.add_request("again", _prompt(0), GREEDY)
    outs = run(engine)["again"]
    assert outs[-1].num_cached_tokens == 64 and tokens(outs) == first[0]
    assert "file in" in engine.describe()


@pytest.mark.parametrize("config, message", [
    (dict(kv_spill_bytes=-1), "kv_spill_bytes"),
    (dict(kv_spill_dir="/tmp"), "--kv-spill-gb"),
    (dict(kv_spill_bytes=1 << 20, kv_spill_dtype="fp8"), "kv_spill_dtype"),
    (dict(kv_spill_bytes=1 << 20, enable_prefix_caching=False), "prefix caching"),
])
def test_bad_spill_settings_are_clear_errors(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="dummy:tiny", **config)


def test_a_missing_spill_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        EngineConfig(model="dummy:tiny", kv_spill_bytes=1 << 20, kv_spill_dir=str(tmp_path / "nope"))


def test_the_worker_refuses_a_bad_spill_flag_before_it_starts():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "services.cli", "prefill", "--kv-spill-gb", "0.1",
                          "--kv-spill-dir", "/nonexistent-dir"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "is not a directory" in out.stderr + out.stdout
