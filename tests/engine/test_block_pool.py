"""BlockPool bookkeeping: ref counts, LRU eviction of cached blocks, verified
prefix hits, KV events, and the block-hash function routers share."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.engine.block_hash import hash_block, hash_prompt_blocks
from services.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from services.engine.kv_manager import KVManager
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams

BS = 4
NS = "model-a|float32|bs4"


def cached_sequence(pool: BlockPool, tokens: list[int], namespace: str = NS) -> tuple[list[int], list[int]]:
    """Allocate and cache the full blocks of ``tokens`` as one sequence; returns (blocks, hashes)."""
    hashes = hash_prompt_blocks(tokens, BS, namespace)
    blocks = pool.allocate(len(hashes))
    pool.cache_blocks(blocks, hashes, tokens[: len(hashes) * BS], None)
    return blocks, hashes


def removed_hashes(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


# ---- allocation and reference counts ------------------------------------------------------


def test_allocate_hands_out_distinct_non_null_blocks_until_exhausted():
    pool = BlockPool(num_blocks=6, block_size=BS)
    assert (pool.num_usable, pool.num_free, pool.num_used) == (5, 5, 0)
    blocks = pool.allocate(3) + pool.allocate(2)
    assert sorted(blocks) == [1, 2, 3, 4, 5]  # block 0 pads block tables and is never handed out
    assert (pool.num_free, pool.num_used) == (0, 5)
    with pytest.raises(MemoryError, match="need 1 KV blocks, 0 free"):
        pool.allocate(1)
    pool.free(blocks)
    assert (pool.num_free, pool.num_used) == (5, 0)


def test_failed_allocation_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=BS)
    held = pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(1) not in held


def test_shared_block_is_free_only_after_its_last_reference():
    pool = BlockPool(num_blocks=8, block_size=BS)
    tokens = list(range(100, 108))
    blocks, hashes = cached_sequence(pool, tokens)
    assert pool.lookup_prefix(hashes, tokens) == blocks  # a second holder
    assert [pool.ref_counts[b] for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_used == 2  # still held by the second holder
    pool.free(blocks)
    assert pool.num_used == 0


def test_double_free_raises():
    pool = BlockPool(num_blocks=4, block_size=BS)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match=f"double free of KV block {block}"):
        pool.free([block])
    assert pool.num_free == 3  # the bad free did not add the block twice


def test_pool_rejects_degenerate_sizes():
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, block_size=BS)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=0)


# ---- LRU eviction -------------------------------------------------------------------------


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(num_blocks=4, block_size=BS)  # 3 usable
    seqs = [list(range(10 * i, 10 * i + BS)) for i in range(3)]
    held = [cached_sequence(pool, s) for s in seqs]
    for i in (1, 0, 2):  # free order: seq1, seq0, seq2
        pool.free(held[i][0])
    pool.take_events()

    pool.allocate(1)
    assert removed_hashes(pool.take_events()) == held[1][1]
    assert pool.lookup_prefix(held[1][1], seqs[1]) == []  # evicted
    pool.allocate(1)
    assert removed_hashes(pool.take_events()) == held[0][1]
    # seq2 was freed last and is still served from the cache
    assert pool.lookup_prefix(held[2][1], seqs[2]) == held[2][0]


def test_uncached_free_blocks_are_reused_before_any_cached_block_is_evicted():
    # a finished request's partial last block (never cached) is freed after its cached blocks;
    # reusing it first keeps every cached block a hit for as long as uncached room remains
    pool = BlockPool(num_blocks=6, block_size=BS)  # 5 usable
    tokens = list(range(500, 500 + 2 * BS))
    blocks, hashes = cached_sequence(pool, tokens)
    private = pool.allocate(3)  # a partial block and two more that were never cached
    pool.free(list(reversed(blocks + private)))
    pool.take_events()

    reused = pool.allocate(3)
    assert sorted(reused) == sorted(private) and pool.take_events() == []  # nothing evicted
    assert pool.lookup_prefix(hashes, tokens) == blocks
    pool.free(blocks)
    pool.free(reused)


def test_sequence_freed_in_reverse_keeps_its_head_longest():
    pool = BlockPool(num_blocks=5, block_size=BS)  # 4 usable
    tokens = list(range(200, 200 + 4 * BS))
    blocks, hashes = cached_sequence(pool, tokens)
    pool.free(list(reversed(blocks)))
    pool.take_events()

    # pressure for one block at a time: the tail goes first, the head last
    evicted = []
    for _ in range(4):
        pool.allocate(1)
        evicted += removed_hashes(pool.take_events())
    assert evicted == list(reversed(hashes))


def test_finished_request_is_evicted_tail_first():
    # the same property through KVManager, which is what the engine calls on finish/abort/preempt
    pool = BlockPool(num_blocks=5, block_size=BS)
    kv = KVManager(pool, NS)
    req = Request("r", list(range(700, 700 + 4 * BS)), SamplingParams())
    assert kv.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    hashes = list(req.block_hashes)
    assert len(hashes) == 4 and pool.num_free == 0
    kv.free(req)
    pool.take_events()

    pool.allocate(1)
    assert removed_hashes(pool.take_events()) == [hashes[3]]
    again = Request("again", list(req.prompt_token_ids), SamplingParams())
    assert kv.match_prefix(again) == 3 * BS  # the head is still cached
    kv.free(again)


def test_partially_evicted_sequence_still_hits_its_head():
    pool = BlockPool(num_blocks=5, block_size=BS)
    tokens = list(range(300, 300 + 4 * BS))
    blocks, hashes = cached_sequence(pool, tokens)
    pool.free(list(reversed(blocks)))
    other = pool.allocate(2)  # evicts the last two blocks
    hits = pool.lookup_prefix(hashes, tokens)
    assert hits == blocks[:2]
    pool.free(hits)
    pool.free(other)


def test_prefix_hit_takes_cached_block_off_the_free_list():
    pool = BlockPool(num_blocks=3, block_size=BS)  # 2 usable
    tokens = list(range(BS))
    blocks, hashes = cached_sequence(pool, tokens)
    pool.free(blocks)
    assert pool.lookup_prefix(hashes, tokens) == blocks
    assert pool.num_free == 1
    (fresh,) = pool.allocate(1)
    assert fresh not in blocks  # the block in use is never handed out again
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(blocks + [fresh])


# ---- prefix lookup ----------------------------------------------------------------------


def test_lookup_returns_longest_cached_run_and_counts_stats():
    pool = BlockPool(num_blocks=8, block_size=BS)
    tokens = list(range(1000, 1000 + 3 * BS))
    blocks, _ = cached_sequence(pool, tokens)
    pool.free(list(reversed(blocks)))

    longer = tokens + list(range(5000, 5000 + 2 * BS))
    hits = pool.lookup_prefix(hash_prompt_blocks(longer, BS, NS), longer)
    assert hits == blocks
    assert (pool.prefix_queries, pool.prefix_hits) == (5, 3)
    pool.free(hits)

    # a different first block: no hit at all, even though later tokens agree
    diverged = [7] + tokens[1:]
    assert pool.lookup_prefix(hash_prompt_blocks(diverged, BS, NS), diverged) == []


def test_forged_hash_collision_is_a_miss():
    pool = BlockPool(num_blocks=4, block_size=BS)
    wanted = [1, 2, 3, 4]
    other = [9, 9, 9, 9]
    (h,) = hash_prompt_blocks(wanted, BS, NS)
    (block,) = pool.allocate(1)
    pool.cache_blocks([block], [h], other, None)  # another block's tokens under wanted's hash
    pool.free([block])

    assert pool.lookup_prefix([h], wanted) == []
    assert pool.ref_counts[block] == 0 and pool.num_used == 0
    assert pool.prefix_hits == 0
    assert pool.lookup_prefix([h], other) == [block]  # the stored tokens themselves still hit
    pool.free([block])


def test_disabled_prefix_caching_never_hits_or_publishes():
    pool = BlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    tokens = list(range(BS))
    blocks, hashes = cached_sequence(pool, tokens)
    pool.free(blocks)
    assert pool.lookup_prefix(hashes, tokens) == []
    assert pool.take_events() == []


def test_duplicate_hash_keeps_the_older_block():
    pool = BlockPool(num_blocks=6, block_size=BS)
    tokens = list(range(40, 40 + 2 * BS))
    first, hashes = cached_sequence(pool, tokens)
    pool.take_events()
    second = pool.allocate(2)  # the same prompt computed again elsewhere
    pool.cache_blocks(second, hashes, tokens, None)
    assert pool.take_events() == []  # nothing new was stored
    pool.free(first)
    pool.free(second)
    assert pool.lookup_prefix(hashes, tokens) == first
    pool.free(first)


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=6, block_size=BS)
    tokens = list(range(2 * BS))
    blocks, hashes = cached_sequence(pool, tokens)
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # blocks still in use
    pool.free(blocks)
    assert pool.reset_prefix_cache() is True
    assert sorted(removed_hashes(pool.take_events())) == sorted(hashes)
    assert pool.lookup_prefix(hashes, tokens) == []


# ---- KV events --------------------------------------------------------------------------


def test_stored_event_carries_parent_hash_and_tokens():
    pool = BlockPool(num_blocks=8, block_size=BS)
    tokens = list(range(500, 500 + 3 * BS))
    hashes = hash_prompt_blocks(tokens, BS, NS)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:1], hashes[:1], tokens[:BS], None)
    pool.cache_blocks(blocks[1:], hashes[1:], tokens[BS:], hashes[0])

    events = pool.take_events()
    assert events == [
        BlockStored((hashes[0],), None, tuple(tokens[:BS])),
        BlockStored(tuple(hashes[1:]), hashes[0], tuple(tokens[BS:])),
    ]
    assert pool.take_events() == []  # drained
    pool.free(blocks)
    assert pool.take_events() == []  # freeing keeps them cached: no removal yet


def test_store_skipping_an_already_cached_block_splits_the_event_run():
    pool = BlockPool(num_blocks=8, block_size=BS)
    tokens = list(range(600, 600 + 3 * BS))
    hashes = hash_prompt_blocks(tokens, BS, NS)
    (middle_owner,) = pool.allocate(1)
    pool.cache_blocks([middle_owner], [hashes[1]], tokens[BS : 2 * BS], hashes[0])
    pool.take_events()

    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, hashes, tokens, None)
    assert pool.take_events() == [
        BlockStored((hashes[0],), None, tuple(tokens[:BS])),
        BlockStored((hashes[2],), hashes[1], tuple(tokens[2 * BS :])),
    ]
    pool.free(blocks + [middle_owner])


def test_eviction_publishes_removed_event():
    pool = BlockPool(num_blocks=3, block_size=BS)  # 2 usable
    tokens = list(range(2 * BS))
    blocks, hashes = cached_sequence(pool, tokens)
    pool.free(list(reversed(blocks)))
    pool.take_events()
    pool.allocate(2)
    assert pool.take_events() == [BlockRemoved((hashes[1], hashes[0]))]


# ---- the shared hash function -------------------------------------------------------------

_HASH_SCRIPT = """
import json, sys
from services.engine.block_hash import hash_block, hash_prompt_blocks
tokens, ns = json.loads(sys.argv[1]), sys.argv[2]
print(json.dumps({"prompt": hash_prompt_blocks(tokens, 16, ns), "block": hash_block(None, tokens[:16], ns)}))
"""


def test_hashes_are_stable_across_processes():
    tokens = list(range(49000, 49000 + 50))
    ns = "SmolLM2-135M-Instruct|bfloat16|bs16"
    local = {"prompt": hash_prompt_blocks(tokens, 16, ns), "block": hash_block(None, tokens[:16], ns)}
    env = dict(os.environ, PYTHONHASHSEED="12345")  # Python's own hash() would change with this
    out = subprocess.run([sys.executable, "-c", _HASH_SCRIPT, json.dumps(tokens), ns], env=env,
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == local
    assert len(local["prompt"]) == 3  # only full blocks are hashed
    assert local["block"] == local["prompt"][0]


def test_hashes_chain_over_the_prefix():
    a = list(range(32))
    b = [99] + a[1:]
    ha, hb = hash_prompt_blocks(a, 16, NS), hash_prompt_blocks(b, 16, NS)
    assert ha[0] != hb[0]
    assert ha[1] != hb[1]  # same tokens in block 1, different prefix
    assert ha[1] == hash_block(ha[0], a[16:], NS)


def test_hashes_are_namespaced():
    tokens = list(range(64))
    assert hash_prompt_blocks(tokens, 16, "model-a") != hash_prompt_blocks(tokens, 16, "model-b")
    assert set(hash_prompt_blocks(tokens, 16, "model-a")).isdisjoint(hash_prompt_blocks(tokens, 16, "model-b"))
    assert hash_block(None, tokens[:16], "m|bfloat16|bs16") != hash_block(None, tokens[:16], "m|float32|bs16")


# ---- tails: the block after a full block, for a repeated prompt's rest --------------------


def test_a_cached_block_is_the_tail_of_the_block_before_it():
    pool = BlockPool(num_blocks=6, block_size=BS)
    tokens = list(range(2 * BS))
    blocks, hashes = cached_sequence(pool, tokens)
    assert pool.find_tail(hashes[0], tokens[BS:BS + 3]) == (blocks[1], 3)
    assert pool.find_tail(hashes[0], [tokens[BS], 99]) == (blocks[1], 1)  # the common part
    assert pool.find_tail(hashes[0], [99]) is None and pool.find_tail(hashes[1], [1]) is None
    pool.free(list(reversed(blocks)))
    pool.allocate(pool.num_free)  # every block handed out: evicted, and no tail any more
    assert pool.find_tail(hashes[0], tokens[BS:BS + 3]) is None


def test_a_kept_partial_block_outlives_uncached_ones_and_is_forgotten_when_handed_out():
    pool = BlockPool(num_blocks=5, block_size=BS)  # 4 usable
    head, hashes = cached_sequence(pool, list(range(BS)))
    partial, plain = pool.allocate(2)
    pool.keep_partial(partial, hashes[0], (7, 8))
    pool.free([partial, plain])
    assert pool.find_tail(hashes[0], [7, 8, 9]) == (partial, 2)
    first, second = pool.allocate(2)
    assert first == plain and second != partial  # blocks holding nothing go first
    [last] = pool.allocate(1)
    assert last == partial and pool.find_tail(hashes[0], [7, 8]) is None  # handed out: forgotten
    pool.free([first, second, last])
    pool.keep_partial(partial, hashes[0], (7, 8))  # a free block has no holder whose KV it keeps
    assert pool.find_tail(hashes[0], [7, 8]) is None
    pool.free(head)
    assert pool.reset_prefix_cache() and pool.tails == {}
