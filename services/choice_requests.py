"""A worker request of n choices (``WorkerRequest.choices``): its choices' ids, result streams and sampling.

Read by both workers: the prefill worker computes the prompt once and samples every choice's first
token, the decode worker forks and decodes them (services/decode/choices.py). Choice 0 is the
request's own id and ``results_to``; choice i (i >= 1) is ``choice_ids[i - 1]`` and
``choice_results_to[i - 1]``, seeded seed + i.
"""

from __future__ import annotations

import dataclasses

from proto.pdserve.v1 import worker_pb2
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError
from services.queue.message import MAX_CHOICES, choice_seed


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Every choice's sampling parameters: the request's, choice i with seed + i when it has a seed."""
    return [params if params.seed is None or i == 0 else dataclasses.replace(params, seed=choice_seed(params.seed, i))
            for i in range(n)]


def choice_targets(req: worker_pb2.WorkerRequest) -> tuple[list[str], list[str]]:
    """(engine request ids, result streams) of the call's choices, choice 0's first; INVALID_ARGUMENT when the
    lists do not name every choice."""
    n = req.choices
    if not 1 < n <= MAX_CHOICES:
        raise InvalidRequestError(f"choices must be in [2, {MAX_CHOICES}], got {n}", param="choices")
    ids = [req.request_id, *req.choice_ids]
    targets = [req.results_to, *req.choice_results_to] if req.results_to else [""] * n
    if len(ids) != n or len(targets) != n or len(set(ids)) != n or not all(ids):
        raise InvalidRequestError(f"choice_ids (and, in results mode, choice_results_to) must name the {n - 1} "
                                  "choices after the first, each once", param="choice_ids")
    return ids, targets
