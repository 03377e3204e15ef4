"""Per-request use of the block pool: which blocks a request holds and which of
them are in the prefix cache. No torch: the runner maps block ids to tensors.

A request's blocks cover its first ``num_computed_tokens + scheduled`` tokens::

    block_ids:  [ b7 ][ b2 ][ b9 ][ b4 ]
    tokens:      0-15  16-31 32-47 48-..   (block_size 16)
                 \\_ cached (full, hashed) _/ \\ partial: private

Blocks in progress: an admitted request's full prompt blocks that it has not
computed yet are *claimed*: their hashes sit in an in-progress set until the
blocks are cached (computed) or the request lets go of them (finish, abort,
preemption). The scheduler defers a waiting request whose next uncached
block is claimed, so a burst of requests sharing a prefix computes it once and
the rest hit it (``waits_for_computing``)::

    running A:  [ cached ][ claimed: this step's chunk ][ claimed: later chunks ][ suffix ]
    waiting B:  [ would hit ][ claimed by A: wait until A has cached them, then hit them ][ own ]

A repeated prompt's last block: when every full block of a prompt hits, the block that followed
the last of them for an earlier request (cached, or its partial last block kept when it finished:
``BlockPool.find_tail``) may hold KV for the start of this prompt's rest. Its KV is copied into the
request's own block (``copy_blocks``, the runner's), and only the rest is computed::

    earlier A:  [ cached ][ cached ][ b5: prompt tail + output ]
    new B:      [ hit    ][ hit    ][ b9 <- copy of b5: its tail but the last token ][ last token: computed ]

Restore from the spill tier (``--kv-spill-gb``): a waiting request whose leading blocks miss the
pool but hit the spill tier (verified against the tokens stored with them) gets blocks for them
at once and their KV copied back on the spill store's own thread, while the engine keeps stepping
the other requests; the request stays waiting until the copy is done, then is admitted with those
blocks computed and cached. The copied hashes are claimed meanwhile, so a request sharing them
waits and hits them instead of computing them::

    waiting A:  [ pool hits ][ restoring: copied back off the engine thread ][ to compute ]
                 \\_ held, cached _/ \\_ held, claimed, not yet cached ____/
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.block_hash import hash_block
from services.engine.block_pool import BlockPool
from services.engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class Restore:
    """Blocks of a waiting request being copied back from the spill tier."""

    handle: object  # the store's future: done(), result()
    slots: list[int]  # spill slots being read (pinned until released)
    start: int  # first block index of the run in the request
    blocks: list[int]  # pool blocks being written, one per slot
    started: float = field(default_factory=time.perf_counter)


class KVManager:
    def __init__(self, pool: BlockPool, namespace: str):
        self.pool = pool
        self.block_size = pool.block_size
        self.namespace = namespace
        self._computing: dict[int, int] = {}  # hash of a claimed block -> running requests claiming it
        self._in_flight: dict[str, Restore] = {}  # request id -> its restore from the spill tier
        # copies whole blocks' KV, [(source, destination)] (the runner's; set by the engine): a repeated
        # prompt's last block. None: not done.
        self.copy_blocks: Callable[[list[tuple[int, int]]], None] | None = None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        bs = self.block_size
        tokens = req.all_token_ids
        namespace = req.namespace or self.namespace  # a LoRA request's blocks: its adapter's namespace
        while len(req.block_hashes) < num_full_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], namespace))

    def cached_prefix_tokens(self, req: Request) -> int:
        """Prompt tokens a waiting request will not compute itself: its leading blocks that are
        cached now or claimed by a running request (it waits for those; see ``waits_for_computing``).
        No side effects."""
        hashes = self._hit_hashes(req)
        n = self.pool.cached_run(hashes)
        while n < len(hashes) and hashes[n] in self._computing:
            n += 1
        return n * self.block_size

    def waits_for_computing(self, req: Request) -> bool:
        """Should a waiting request (holding no blocks) wait before admission? True when the first
        block of its prompt that is not cached is being computed by a running request: admitted
        now, it would compute that block a second time; once the block is cached, it hits.

        Never true for long: a claim ends when its block is cached or its request finishes, is
        aborted or preempted, and a running request always progresses. No side effects.
        """
        if not self._computing:
            return False
        hashes = self._hit_hashes(req)
        n = self.pool.cached_run(hashes)
        return n < len(hashes) and hashes[n] in self._computing

    def _hit_hashes(self, req: Request) -> list[int]:
        """Hashes of the leading full blocks a prefix-cache hit may cover: all but the block
        holding the last token, which must be computed so the step yields logits."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        return req.block_hashes[:max_blocks]

    def claim_computing(self, req: Request) -> None:
        """Announce that an admitted request will compute the full blocks of its prompt that it did
        not find cached (over this and later steps, chunk by chunk). Call when it starts running."""
        if not self.pool.enable_prefix_caching:
            return
        end = req.num_prompt_tokens // self.block_size
        start = max(req.num_cached_blocks, req.num_claimed_blocks)
        if end <= start:
            return
        self._extend_hashes(req, end)
        for h in req.block_hashes[start:end]:
            self._computing[h] = self._computing.get(h, 0) + 1
        req.num_claimed_blocks = end

    def _unclaim(self, req: Request, start: int, end: int) -> None:
        for h in req.block_hashes[start:end]:
            left = self._computing[h] - 1
            if left:
                self._computing[h] = left
            else:
                del self._computing[h]

    @property
    def num_claimed_blocks(self) -> int:
        """Distinct blocks running requests are computing now (0 when idle: the leak check)."""
        return len(self._computing)

    def match_prefix(self, req: Request) -> int:
        """Reuse cached blocks for the longest known prefix of a request that holds
        none. At least one token is left to compute, so the step yields logits.
        Returns the number of tokens found."""
        assert not req.block_ids, "prefix matching is for requests without blocks"
        hashes = self._hit_hashes(req)
        hits = self.pool.lookup_prefix(hashes, req.all_token_ids)
        req.block_ids = hits
        req.num_cached_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.block_size
        req.num_prefix_hit_tokens = req.num_computed_tokens
        req.num_restored_tokens = 0
        if self.pool.spill is not None and len(hits) < len(hashes):
            self._start_restore(req, hashes, len(hits))
        elif hits and len(hits) == len(hashes) and self.copy_blocks is not None:
            self._copy_tail(req)
        return req.num_computed_tokens

    def _copy_tail(self, req: Request) -> None:
        """After every full block hit: copy the KV of the block that followed them for an earlier request,
        as far as its tokens begin this prompt's rest (all but the last token, computed for the logits)."""
        start = req.num_computed_tokens
        rest = req.all_token_ids[start:req.num_tokens - 1]
        found = self.pool.find_tail(req.block_hashes[len(req.block_ids) - 1], rest) if rest else None
        if found is None or not self.pool.num_free:
            return
        src, n = found
        [dst] = self.pool.allocate(1)  # may be src itself (the last free block): then its KV is already there
        self.copy_blocks([(src, dst)])
        req.block_ids.append(dst)
        req.num_computed_tokens += n
        req.num_prefix_hit_tokens += n

    def _keep_partial(self, req: Request) -> None:
        """Before a request's blocks are freed: keep its partial last block's KV findable (the pool drops it
        when it hands the block out again)."""
        computed = min(req.num_computed_tokens, len(req.all_token_ids))
        full, part = divmod(computed, self.block_size)
        if not part or not full or len(req.block_ids) <= full or not self.pool.enable_prefix_caching:
            return
        self._extend_hashes(req, full)
        self.pool.keep_partial(req.block_ids[full], req.block_hashes[full - 1],
                               req.all_token_ids[full * self.block_size:computed])

    # ---- restore from the spill tier --------------------------------------
    def _start_restore(self, req: Request, hashes: list[int], start: int) -> None:
        spill = self.pool.spill
        n = min(spill.match(hashes, req.all_token_ids, start), self.pool.num_free)
        if n == 0:
            return
        run = hashes[start:start + n]
        slots = spill.take(run)  # pinned before allocating: an eviction below may spill, never into these
        blocks = self.pool.allocate(n)
        for h in run:
            self._computing[h] = self._computing.get(h, 0) + 1
        req.block_ids.extend(blocks)
        req.restore = self._in_flight[req.request_id] = Restore(spill.storage.restore(slots, blocks), slots,
                                                                 start, blocks)

    def restoring(self, req: Request) -> bool:
        """Is a waiting request's restore still copying? A finished one is completed here: its blocks
        cached and counted as computed (or, had the copy failed, freed, to be computed)."""
        r = req.restore
        if r is None:
            return False
        if not r.handle.done():
            return True
        self._finish_restore(req)
        return False

    def wait_restores(self, timeout: float) -> None:
        """Block up to ``timeout`` s for any restore to finish (the engine has nothing else to run)."""
        pending = [r.handle for r in self._in_flight.values() if not r.handle.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    @property
    def num_restoring(self) -> int:
        """Restores in flight (0 when idle: the leak check)."""
        return len(self._in_flight)

    def _finish_restore(self, req: Request) -> None:
        r, req.restore = req.restore, None
        del self._in_flight[req.request_id]
        spill = self.pool.spill
        try:
            r.handle.result()
            ok = True
        except Exception:  # a copy that failed leaves garbage: free the blocks, compute them instead
            log.exception("restoring %d KV blocks from the spill tier failed; computing them", len(r.blocks))
            ok = False
        spill.release(r.slots)
        spill.stats.restore_seconds += time.perf_counter() - r.started
        end = r.start + len(r.blocks)
        self._unclaim(req, r.start, end)
        if not ok:
            self.pool.free(reversed(r.blocks))
            del req.block_ids[r.start:]
            return
        bs = self.block_size
        self.pool.cache_blocks(r.blocks, req.block_hashes[r.start:end], req.all_token_ids[r.start * bs:end * bs],
                               req.block_hashes[r.start - 1] if r.start else None)
        spill.stats.restored_blocks += len(r.blocks)
        req.num_cached_blocks = end
        req.num_computed_tokens = end * bs
        req.num_prefix_hit_tokens = req.num_computed_tokens
        req.num_restored_tokens = len(r.blocks) * bs

    def allocate(self, req: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Grow ``req.block_ids`` to hold ``num_new_tokens`` more tokens, leaving at
        least ``reserve`` blocks free. False (and no change) if they don't fit."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need + reserve > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish the request's full, computed blocks to the prefix cache."""
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        self._extend_hashes(req, num_full)
        start = req.num_cached_blocks
        self._unclaim(req, start, min(num_full, req.num_claimed_blocks))
        bs = self.block_size
        self.pool.cache_blocks(
            req.block_ids[start:num_full],
            req.block_hashes[start:num_full],
            req.all_token_ids[start * bs : num_full * bs],
            req.block_hashes[start - 1] if start else None,
        )
        req.num_cached_blocks = num_full

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give ``child`` (holding nothing) the parent's computed KV: the full blocks shared (one more
        reference each, read-only from now on: both only append past them) and the partial last block
        copied into a block of its own, which both will write into::

            parent:  [ b3 ][ b8 ][ b5: 7 of 16 ]
            child:   [ b3 ][ b8 ][ b11 <- copy of b5 ]   (b3, b8: ref 2)

        Returns the (source, destination) block the caller copies the KV of, None when the computed
        tokens end on a block boundary; raises MemoryError (and changes nothing) without a free block."""
        assert not child.block_ids, "a fork starts from nothing"
        computed = parent.num_computed_tokens
        full, partial = divmod(computed, self.block_size)
        copy = None
        if partial:
            [dst] = self.pool.allocate(1)
            copy = (parent.block_ids[full], dst)
        shared = parent.block_ids[:full]
        self.pool.share(shared)
        child.block_ids = [*shared, *([copy[1]] if copy else [])]
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        child.num_computed_tokens = computed
        return copy

    def free(self, req: Request) -> None:
        """Return every block the request holds (tail first, so it is evicted first). A restore in
        flight is waited for first (its copy writes into the blocks), then kept: the blocks are cached."""
        if req.restore is not None:
            try:
                req.restore.handle.result()
            except Exception:
                pass  # _finish_restore reports it and frees the blocks uncached
            self._finish_restore(req)
        self._unclaim(req, req.num_cached_blocks, req.num_claimed_blocks)
        req.num_claimed_blocks = 0
        if req.block_ids:
            self._keep_partial(req)
            self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
