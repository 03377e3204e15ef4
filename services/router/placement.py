"""Where one request runs: its decode worker, and its prefill worker or a local prefill.

The decisions of one dispatch attempt, apart from the RPCs that carry them out,
so that the router (``dispatch.Dispatcher``) and the cluster simulator
(``services/sim``) run the same code: the policy's decode choice, its prefill
choice, conditional disaggregation, and the bookkeeping that follows a choice
(the prefix index's prediction and the pool's in-flight count).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.registry import WorkerInfo
from services.router.policy import (
    Decision,
    RouterPolicyConfig,
    RoutingPolicy,
    decode_is_busy,
    should_prefill_locally,
)
from services.router.prefix_index import PrefixIndex
from services.router.worker_pool import InflightToken, WorkerPool


@dataclass(frozen=True)
class Placement:
    decode: Decision
    prefill: Decision | None  # None: the decode worker prefills the prompt itself


def place(policy: RoutingPolicy, policy_config: RouterPolicyConfig, disaggregation: str, pool: WorkerPool,
          index: PrefixIndex, decode_workers: Sequence[WorkerInfo], prefill_workers: Sequence[WorkerInfo],
          hashes: Sequence[int], num_tokens: int, block_size: int, avoid_decode: Iterable[str] = (),
          session_key: str = "", extra_blocks: int = 0) -> Placement:
    """Choose the workers for a prompt of ``num_tokens`` tokens whose full blocks hash to ``hashes``.

    ``disaggregation``: auto (conditional) | always | never. ``session_key``: the request's
    affinity key ("" for none), for the decode choice (see policy.py). Raises what ``choose_decode`` raises
    (NoWorkerError, CapacityError) when no decode worker can take the prompt. ``extra_blocks``: blocks the
    decode worker needs beside the prompt's (n choices' copies of its partial last block).
    """
    blocks_needed = -(-num_tokens // block_size) + extra_blocks
    decode = policy.choose_decode(decode_workers, blocks_needed, pool, exclude=avoid_decode,
                                  session_key=session_key, block_hashes=hashes, index=index)
    if not prefill_workers or disaggregation == "never":
        return Placement(decode, None)
    prefill = policy.choose_prefill(prefill_workers, hashes, block_size, pool, index)
    if disaggregation != "always" and _prefill_locally(policy_config, pool, index, decode.worker, num_tokens,
                                                       hashes, prefill):
        return Placement(decode, None)
    return Placement(decode, prefill)


def _prefill_locally(config: RouterPolicyConfig, pool: WorkerPool, index: PrefixIndex, decode: WorkerInfo,
                     num_tokens: int, hashes: Sequence[int], prefill: Decision) -> bool:
    held = index.overlap(decode.worker_id, hashes)
    uncached = num_tokens - held * decode.block_size
    if config.local_prefill_cached and held and uncached <= decode.block_size:
        # The decode worker holds every full block of the prompt (a repeated prompt, the next turn of its
        # conversation): what is left is less than a block, cheaper to compute in its next step than a
        # prefill worker's round trip, reservation and KV hand-off (pdserve bench hops)
        return True
    queue = pool.load(prefill.worker.worker_id).pending_prefill_tokens
    busy = decode_is_busy(pool.load(decode.worker_id), config)
    return should_prefill_locally(uncached, queue, True, config, decode_busy=busy)


def begin_prefill(pool: WorkerPool, index: PrefixIndex, prefill: Decision, hashes: Sequence[int], num_tokens: int,
                  block_size: int) -> InflightToken:
    """Record a disaggregated prefill sent to ``prefill.worker``: the index predicts the worker's
    cache (the next request with this prefix goes there even before its KV events arrive; they
    confirm this, or remove what it evicts) and the pool counts the tokens it will compute."""
    worker = prefill.worker
    index.touch(worker.worker_id, hashes, worker.kv_cache_capacity)
    held = max(prefill.overlap_blocks, prefill.fetch.blocks if prefill.fetch is not None else 0)
    return pool.begin(worker.worker_id, num_tokens - held * block_size)


def begin_decode(pool: WorkerPool, decode: Decision) -> InflightToken:
    """Count a disaggregated request on its decode worker as well as its prefill worker. Without it
    the decode worker's load moved only with its heartbeat, so every request placed between two
    heartbeats chose the same least-loaded decode worker until its KV was full (``pdserve bench
    sim`` at 1,000 workers: one worker took a second's arrivals, the rest retried RESOURCE_EXHAUSTED)."""
    return pool.begin(decode.worker.worker_id)
