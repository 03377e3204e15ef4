"""The peer-fetch cost model: the third choice for a prompt whose prefix another worker holds.

For a prompt of ``num_tokens`` tokens whose leading blocks a holder ``h`` has cached
(``overlap_h`` blocks, in its pool or its spill tier) and a candidate worker ``w`` has fewer of
(``overlap_w``), the kv-aware policy weighs, in its unit (prompt tokens of prefill time):

    route to h:        cost(h) = uncached_h + queue terms of h              (the policy, as before)
    recompute on w:    uncached_w = num_tokens - overlap_w * block_size     (+ its own restores)
    fetch to w from h: num_tokens - overlap_h * block_size                  (what w still computes)
                       + prefill_tokens_per_s * (overlap_h * block_bytes / bandwidth + fixed_s)
                       + block_size                                         (h recomputes the last block)
                       + min(pending_prefill_tokens(h), HOLDER_STEP_TOKENS) (h's step in progress)
                       + restore_token_cost * block_size * spilled_h        (h copies spilled blocks back)

and ``w`` takes the cheaper of its two (queue terms of w added by the policy as for any
worker). The whole prefix is fetched (the puller holds nothing of it while it arrives), so a
fetch pays for ``overlap_h`` blocks, not the difference. The holder serves a fetch ahead of its
waiting requests (``services/peer_fetch.py``: ``FETCH_PRIORITY``), so its queue costs a fetch at
most the step it is running, not the queue: that is what makes a fetch worth it exactly when the
holder is busy.

Measured on the 2-core Xeon with the default model (BENCHMARKS.md: ``bench kvtransfer``,
``bench kvtier``): UCX moves 3.7-5.6 GB/s between two processes (2 GB/s assumed here, a margin
for a loaded host), a 368 KB block; prefill runs ~600 tokens/s on one thread. A block then costs
~0.18 ms to fetch against ~27 ms to compute: 0.007 of a token per token, so a fetch wins
whenever the holder is not on a different continent; on a GPU (prefill 10-50k tokens/s, the
same transfer) a token fetched costs 0.1-0.5 of one computed, and short prefixes stay local.
The router's flags (``--peer-fetch-bandwidth-gbps``, ``--peer-fetch-prefill-tokens-per-s``) set the
two rates for the deployment's hardware. Once a worker has fetched, the bandwidth is the one it
measured (``WorkerInfo.kv_fetch_bytes_per_s``, heartbeated: bytes over seconds from its
reservation to the blocks cached, a moving average), so a host slower than the flag says is
priced as it is. That rate includes the holder's restores and step, which the model adds again:
it overstates a fetch a little, erring towards computing. Measured end to end on the loaded
2-core machine (``bench kvtier`` runs C and D): 49 MB in ~0.67 s, 73 MB/s, far below the link's
GB/s: a 137-block fetch then prices at ~430 tokens against the 2.1k it saves.

Pure logic: no torch, no gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.registry import WorkerInfo

HOLDER_STEP_TOKENS = 512  # the engine's long-prefill chunk: the most a holder's step in progress computes
FIXED_S = 0.005  # a fetch's round trips: the Fetch call, the reservation, the connection's first use


@dataclass(frozen=True)
class FetchPlan:
    holder: WorkerInfo
    blocks: int  # leading full blocks of the prompt to fetch (the holder's overlap)
    cost: float  # the fetch alternative's cost on the puller, in prompt tokens (see above)


def fetch_tokens(blocks: int, block_bytes: int, block_size: int, holder_pending_tokens: int,
                 bandwidth_bytes_per_s: float, prefill_tokens_per_s: float) -> float:
    """What fetching ``blocks`` blocks costs, in prompt tokens of prefill time (excluding the
    tokens the puller still computes and the holder's restores)."""
    seconds = blocks * block_bytes / bandwidth_bytes_per_s + FIXED_S
    return seconds * prefill_tokens_per_s + block_size + min(holder_pending_tokens, HOLDER_STEP_TOKENS)


def plan_fetch(worker: WorkerInfo, holders: Sequence[WorkerInfo], overlaps: dict[str, int], spilled: dict[str, int],
               pending: dict[str, int], num_tokens: int, block_size: int, uncached_here: float,
               bandwidth_bytes_per_s: float, prefill_tokens_per_s: float, restore_token_cost: float) -> FetchPlan | None:
    """The cheapest fetch to ``worker`` from one of ``holders``, if it beats computing there.

    ``overlaps``: leading blocks each worker holds; ``spilled``: of those, how many are in its spill
    tier; ``pending``: each worker's pending prefill tokens; ``uncached_here``: what the prompt
    costs ``worker`` without a fetch (the kv-aware policy's uncached tokens). None: no holder has
    more of the prompt than ``worker``, or fetching costs more than computing.
    """
    here = overlaps.get(worker.worker_id, 0)
    best: FetchPlan | None = None
    for h in holders:
        blocks = overlaps.get(h.worker_id, 0)
        block_bytes = h.kv_block_bytes or worker.kv_block_bytes
        if h.worker_id == worker.worker_id or blocks <= here or not block_bytes:
            continue
        cost = (num_tokens - blocks * block_size
                + fetch_tokens(blocks, block_bytes, block_size, pending.get(h.worker_id, 0),
                               bandwidth_bytes_per_s, prefill_tokens_per_s)
                + restore_token_cost * block_size * spilled.get(h.worker_id, 0))
        if cost < uncached_here and (best is None or cost < best.cost):
            best = FetchPlan(h, blocks, cost)
    return best
