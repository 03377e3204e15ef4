"""A Decode call of n choices (``WorkerRequest.choices``): one forked generation, each choice to its own stream.

The router sends an ``n`` > 1 request as one Decode with ``local_prefill`` (the engine computes the
prompt once and forks the choices off it: ``Engine.add_choices``, services/engine/choices.py), or
hands it off: the prefill worker computes the prompt once and samples every choice's first token
(``add_choices(prefill_only=True)``, services/handoff.py), the KV travels once, into choice 0's
reservation here, and ``start_decode(..., choices=)`` forks the others off it.
Choice 0 runs under the call's request id, choice i under ``choice_ids[i - 1]`` (the router's
``<choice id>.<attempt>``, so each choice's chunks are fenced by its own attempt, as a request's
are), seeded seed + i. In results mode every choice's chunks go to its own result stream
(``choice_results_to``) through the step writer; the call carries one Finish per choice, tagged
with its index, each sent once that choice's chunks are all in Redis. Without ``results_to`` the
chunks travel on the call, tagged too.
"""

from __future__ import annotations

import contextlib
import time

from proto.pdserve.v1 import worker_pb2
from services.choice_requests import choice_params, choice_targets
from services.grpc_codec import chunk_from_output, sampling_from_proto
from services.handoff import decode_after_transfer


async def relay_choices(servicer, req: worker_pb2.WorkerRequest, started: float, completion=None):
    """Run the choices (``completion``: their prompt's KV arrived from a prefill worker, with every choice's
    first token; None: computed here); yield TokenChunkOrFinish messages tagged with their choice's index."""
    rt = servicer.rt
    ids, targets = choice_targets(req)
    index = {rid: i for i, rid in enumerate(ids)}
    params = choice_params(sampling_from_proto(req.sampling), len(ids))
    tok = rt.engine.tokenizer
    token_text = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok else None
    results = servicer.results
    first_at: dict[str, float] = {}
    for rid, target in zip(ids, targets):
        if target:  # before the first step: the step writer takes every token from there
            results.track(rid, target)
            rt.aengine.finals_only.add(rid)
    try:
        if completion is None:
            outputs = rt.aengine.generate_choices(ids, list(req.token_ids), params, priority=req.priority)
        else:
            outputs = decode_after_transfer(rt.aengine, ids[0], completion, list(zip(ids[1:], params[1:])))
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.error:
                    raise RuntimeError(out.error)
                i = index[out.request_id]
                if not targets[i] and (out.new_token_ids or out.new_text):
                    first_at.setdefault(out.request_id, time.perf_counter())
                    yield worker_pb2.TokenChunkOrFinish(chunk=chunk_from_output(out, token_text), index=i)
                if out.finished:
                    if targets[i]:
                        await results.flushed(out.request_id)
                        first_at[out.request_id] = results.first_at.get(out.request_id)
                    msg = servicer._finish(out, started, first_at.get(out.request_id))
                    msg.index = i
                    yield msg
    finally:
        for rid, target in zip(ids, targets):
            if target:
                rt.aengine.finals_only.discard(rid)
                results.untrack(rid)
