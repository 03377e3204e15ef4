"""Bookkeeping of the spill tier: which evicted prefix blocks it holds, in which slot. No torch.

The block pool is the first tier. When it evicts a cached block (hashed, ref count 0) to hand
its id out again, the block's KV is copied into a slot of this second tier (host memory or a
memory-mapped file, int8 or the pool's own dtype: ``kv_spill.SpillStore``) instead of being
lost. A later prompt whose leading blocks miss the pool but hit here gets them copied back
(restored) instead of recomputed. Ids and hashes here, bytes in the store, as the pool and the
runner split them (STYLE item 3).

Every cached block lives in exactly one tier::

    pool (ref 0, cached) --evicted--> spill slot --hit: taken, copied back--> pool
                                          |
                                          +--spill full: its least recently spilled slot is dropped

Policy: LRU across both tiers. A block enters the spill tier when the pool's LRU evicts it and
the spill tier drops its least recently spilled block when full; a hit moves the block back to
the pool (the tiers are exclusive, so no byte is held twice). Blocks of a sequence are freed tail
first, so a prefix's tail is spilled, and dropped, before its head: what is dropped is the part
least likely to be reusable (a chained block is useless without its parents). A better policy
would weigh reuse as well as recency (a shared system prompt hit by many sessions against a
one-off tail: S3-FIFO or ARC-style frequency), and would skip spilling prefixes too short to be
worth a restore; see the note in BENCHMARKS.md.

A taken slot (a restore in flight) is *pinned*: out of the index, so nothing else finds it, and
not reusable until ``release``, so no spill overwrites bytes a restore is still reading.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence


class SpillStorage(Protocol):
    """The bytes behind the slots (``services.engine.kv_spill.SpillStore``)."""

    num_slots: int

    def write(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy pool blocks into slots now (before the blocks are handed out again)."""

    def restore(self, slots: Sequence[int], blocks: Sequence[int]):
        """Start copying slots into pool blocks; returns a handle with ``done()`` and ``result()``."""


@dataclass
class SpillStats:
    spilled_blocks: int = 0  # blocks copied in from the pool
    dropped_blocks: int = 0  # blocks the spill tier let go when full (their KV is gone)
    hit_blocks: int = 0  # lookups that found a block here (token-verified)
    restored_blocks: int = 0  # blocks copied back into the pool
    spill_seconds: float = 0.0  # time spent copying in (on the engine thread)
    restore_seconds: float = 0.0  # time spent copying back (off the engine thread)


class SpillTier:
    def __init__(self, storage: SpillStorage, block_size: int):
        if storage.num_slots < 1:
            raise ValueError(f"the spill tier needs at least one slot, got {storage.num_slots}")
        self.storage = storage
        self.block_size = block_size
        self.num_slots = storage.num_slots
        self._entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens)
        self._free_slots: list[int] = list(range(storage.num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots a restore is reading
        self.stats = SpillStats()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def hashes(self) -> list[int]:
        """Every block hash held here, least recently spilled first (a KV-event resync)."""
        return list(self._entries)

    def admit(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]]) -> tuple[list[int | None], list[int]]:
        """Slots for blocks the pool is evicting, dropping the least recently spilled blocks to make
        room. Returns (a slot per block, None where nothing is free: every slot pinned; the hashes
        dropped). The caller copies the blocks in before handing them out. Mutates: entries, slots."""
        slots: list[int | None] = []
        dropped: list[int] = []
        for h, toks in zip(hashes, tokens):
            old = self._entries.pop(h, None)  # the pool never holds a hash this tier holds; be safe
            if old is not None:
                self._free_slots.append(old[0])
            if not self._free_slots and self._entries:
                gone, (slot, _) = self._entries.popitem(last=False)
                dropped.append(gone)
                self._free_slots.append(slot)
            if not self._free_slots:
                slots.append(None)
                continue
            slot = self._free_slots.pop()
            self._entries[h] = (slot, toks)
            slots.append(slot)
        self.stats.dropped_blocks += len(dropped)
        return slots, dropped

    def discard(self, block_hash: int) -> bool:
        """Forget a block (the pool cached the same hash again, computed anew). Mutates: entries."""
        old = self._entries.pop(block_hash, None)
        if old is None:
            return False
        self._free_slots.append(old[0])
        return True

    def match(self, block_hashes: Sequence[int], token_ids: Sequence[int], start: int) -> int:
        """How many blocks from ``block_hashes[start]`` on are here, each verified against the
        tokens it was stored with (a hash collision is a miss). No side effects."""
        bs = self.block_size
        n = 0
        for i in range(start, len(block_hashes)):
            entry = self._entries.get(block_hashes[i])
            if entry is None or entry[1] != tuple(token_ids[i * bs: (i + 1) * bs]):
                break
            n += 1
        return n

    def take(self, block_hashes: Sequence[int]) -> list[int]:
        """Remove blocks ``match`` found and pin their slots for a restore. Mutates: entries, pins."""
        slots = [self._entries.pop(h)[0] for h in block_hashes]
        self._pinned.update(slots)
        self.stats.hit_blocks += len(slots)
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """A restore finished reading these slots: they may be reused."""
        for slot in slots:
            self._pinned.remove(slot)
            self._free_slots.append(slot)

    def clear(self) -> list[int]:
        """Forget every block (prefix-cache reset); pinned slots stay pinned. Returns the hashes."""
        gone = list(self._entries)
        for slot, _ in self._entries.values():
            self._free_slots.append(slot)
        self._entries.clear()
        return gone

    def check(self) -> None:
        """Every slot in exactly one place (held, free or pinned); raises AssertionError otherwise."""
        held = [slot for slot, _ in self._entries.values()]
        every = held + self._free_slots + list(self._pinned)
        if sorted(every) != list(range(self.num_slots)):
            raise AssertionError(f"spill slots out of place: {len(held)} held, {len(self._free_slots)} free, "
                                 f"{len(self._pinned)} pinned of {self.num_slots}")
