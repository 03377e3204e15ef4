"""Bookkeeping for KV blocks: ids, reference counts, the prefix cache, KV events.

The pool never touches the KV tensor (the runner owns that); callers hold block
ids. A block is in exactly one state::

    free (uncached) -> in use (ref > 0) -> free but cached (ref 0, hash kept)
                          ^                        |
                          +---- prefix-cache hit --+      evicted LRU-first

Free blocks sit in one queue that allocation takes from the front: uncached
ones first (they hold nothing reusable, so handing them out costs no hit),
then cached ones least recently freed first, so recently freed prefixes
survive longest::

    front -> [ uncached ][ cached: least ... most recently freed ] <- a freed cached block

Every change to the cache is recorded as a KV event (stored / removed) in the
code path that makes it; ``take_events`` drains them for publication to routers.

Tails: for each full block, the most recent block after it that holds KV for some tokens, with
those tokens: a cached block (the prompt's last block, filled by the output), or a request's last,
partial block kept when it finishes (``keep_partial``: free, in the cached part of the queue, until
it is handed out again). A request that repeats a prompt copies the KV of the tokens such a block
shares with its own rest (``find_tail``) and computes only its last token, not the block's worth
before it (a repeated prompt's first token: llama-server keeps a slot's whole prompt the same way).
Tails are never published: a router's index, the spill tier and peer fetches know full blocks only.

With a spill tier (``spill_tier.SpillTier``, ``--kv-spill-gb``), an evicted cached block is
copied there before its id is handed out again, and its event says so: stored with
``tier="spill"`` (it left this pool for the spill tier) instead of removed. A block the spill
tier drops is removed with ``tier="spill"``. Caching a hash the spill tier holds (computed
anew, or restored) takes it out of the spill tier: every cached block is in one tier.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
import time
from typing import Sequence

from services.engine.spill_tier import SpillTier

POOL, SPILL = "pool", "spill"  # the tiers a KV event names


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None  # None for blocks moved to the spill tier (not a contiguous run)
    token_ids: tuple[int, ...]  # all tokens of the stored blocks, in order
    tier: str = POOL  # where the blocks are now; a block is in one tier at a time


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    tier: str = POOL  # the tier that let them go


KVEvent = BlockStored | BlockRemoved


class BlockPool:
    NULL_BLOCK = 0  # pads block tables; never handed out

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 spill: SpillTier | None = None):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # the hash of a full block -> the latest block after it with KV (cached, or a kept partial one)
        self.tails: dict[int, int] = {}
        self.tail_of: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (parent hash, tokens)
        self.kept: list[bool] = [False] * num_blocks  # a freed partial block kept for its tail
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._events: list[KVEvent] = []
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found
        self.spill = spill if enable_prefix_caching else None  # the second tier; None: evicted KV is gone

    # ---- capacity -------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    # ---- allocation -----------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref 1, evicting the least recently freed cached blocks.

        Mutates: free queue, ref counts; cache and events when it evicts.
        """
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        evicted: list[tuple[int, int, tuple[int, ...]]] = []  # (block, hash, tokens)
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._forget_tail(block)
            h = self.block_hash[block]
            if h is not None:
                evicted.append((block, h, self.block_tokens[block]))
                del self.cached[h]
                self.block_hash[block] = None
                self.block_tokens[block] = None
            self.ref_counts[block] = 1
            out.append(block)
        if evicted:
            self._evict(evicted)
        return out

    def _evict(self, evicted: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Blocks leaving the pool: to the spill tier (their KV copied there now, before the ids
        are handed out), or gone. Mutates: the spill tier, events."""
        if self.spill is None:
            self._events.append(BlockRemoved(tuple(h for _, h, _ in evicted)))
            return
        slots, dropped = self.spill.admit([h for _, h, _ in evicted], [t for _, _, t in evicted])
        if dropped:
            self._events.append(BlockRemoved(tuple(dropped), SPILL))
        kept = [(e, slot) for e, slot in zip(evicted, slots) if slot is not None]
        lost = [h for (_, h, _), slot in zip(evicted, slots) if slot is None]
        if kept:
            started = time.perf_counter()
            self.spill.storage.write([b for (b, _, _), _ in kept], [slot for _, slot in kept])
            self.spill.stats.spill_seconds += time.perf_counter() - started
            self.spill.stats.spilled_blocks += len(kept)
            self._events.append(BlockStored(tuple(h for (_, h, _), _ in kept), None,
                                            tuple(t for (_, _, toks), _ in kept for t in toks), SPILL))
        if lost:
            self._events.append(BlockRemoved(tuple(lost)))

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each block in use (a forked sequence holds its parent's full blocks
        too). Mutates: ref counts."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"cannot share free KV block {block}")
            self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. Callers pass a sequence's blocks in
        reverse so its tail, the least shareable part, is evicted first."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"double free of KV block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None and not self.kept[block]:
                    # nothing to keep: reuse it before evicting anything
                    self._free.move_to_end(block, last=False)

    # ---- prefix cache ---------------------------------------------------
    def lookup_prefix(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """Take a reference on the longest cached run of ``block_hashes``.

        A hash hit is confirmed against the stored tokens, so a collision is a
        miss, never wrong output. Mutates: ref counts, free queue, hit stats.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(block_hashes):
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        self.prefix_queries += len(block_hashes)
        self.prefix_hits += len(hits)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        return hits

    def cached_run(self, block_hashes: Sequence[int]) -> int:
        """How many leading ``block_hashes`` are cached (by hash only). Mutates nothing: an estimate
        for load reports; ``lookup_prefix`` is the real, token-checked lookup."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in block_hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def cache_blocks(self, blocks: Sequence[int], block_hashes: Sequence[int], token_ids: Sequence[int],
                     parent_hash: int | None) -> None:
        """Record full, computed blocks as cached. ``token_ids`` spans all of them;
        ``parent_hash`` is the hash of the block before ``blocks[0]``.

        A hash already cached in another block keeps the older block (this one
        stays private and is freed normally). Each contiguous run of newly
        stored blocks becomes one event. Mutates: cache, events.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_parent = parent_hash
        for i, (block, h) in enumerate(zip(blocks, block_hashes)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if self.block_hash[block] is not None or h in self.cached:
                if run_hashes:
                    self._events.append(BlockStored(tuple(run_hashes), run_parent, tuple(run_tokens)))
                    run_hashes, run_tokens = [], []
                run_parent = h
                continue
            self.block_hash[block] = h
            self.block_tokens[block] = tokens
            self.cached[h] = block
            prev = parent_hash if i == 0 else block_hashes[i - 1]
            if prev is not None:
                self._set_tail(prev, block, tokens)
            if self.spill is not None:
                self.spill.discard(h)  # stored in this pool now (the event says so): one tier per block
            run_hashes.append(h)
            run_tokens.extend(tokens)
        if run_hashes:
            self._events.append(BlockStored(tuple(run_hashes), run_parent, tuple(run_tokens)))

    def keep_partial(self, block: int, parent_hash: int, tokens: Sequence[int]) -> None:
        """Keep, as the tail after ``parent_hash``, a partial block about to be freed by its only holder,
        whose KV holds ``tokens``. Mutates: tails (``free`` then queues it with the cached blocks)."""
        if self.enable_prefix_caching and tokens and self.ref_counts[block] == 1 and self.block_hash[block] is None:
            self._set_tail(parent_hash, block, tuple(tokens))
            self.kept[block] = True

    def find_tail(self, parent_hash: int, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The tail after ``parent_hash`` and how many leading ``tokens`` its KV holds (at least one), or
        None. The block's KV stays valid until the pool hands it out (the caller copies it before that)."""
        block = self.tails.get(parent_hash)
        if block is None:
            return None
        n = 0
        for a, b in zip(self.tail_of[block][1], tokens):
            if a != b:
                break
            n += 1
        return (block, n) if n else None

    def _set_tail(self, parent_hash: int, block: int, tokens: tuple[int, ...]) -> None:
        old = self.tails.get(parent_hash)
        if old is not None:
            self._forget_tail(old)
            if self.ref_counts[old] == 0 and self.block_hash[old] is None:  # now holds nothing: reused first
                self._free.move_to_end(old, last=False)
        self.tails[parent_hash] = block
        self.tail_of[block] = (parent_hash, tokens)

    def _forget_tail(self, block: int) -> None:
        tail, self.tail_of[block], self.kept[block] = self.tail_of[block], None, False
        if tail is not None:
            del self.tails[tail[0]]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash of free blocks; False if blocks are in use."""
        if self.num_used:
            return False
        if self.cached:
            self._events.append(BlockRemoved(tuple(self.cached)))
        if self.spill is not None and len(self.spill):
            self._events.append(BlockRemoved(tuple(self.spill.clear()), SPILL))
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        self.tails.clear()
        self.tail_of = [None] * self.num_blocks
        self.kept = [False] * self.num_blocks
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def has_events(self) -> bool:
        """Whether ``take_events`` would return any. Safe from another thread (one read of a list under the
        GIL): a worker asks before it hops onto the engine thread to drain them."""
        return bool(self._events)
