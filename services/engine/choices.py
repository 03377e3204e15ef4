"""``n`` choices of one prompt in one engine: the prompt computed once, then forked.

``Engine.add_choices`` admits choice 0 as an ordinary request carrying the others (``Request.forks``),
which wait outside the scheduler. The step in which choice 0's prompt is done and its logits row
is ready forks them: each gets choice 0's full prompt blocks by reference and a copy of the partial
last block (``KVManager.fork``, ``ModelRunner.copy_blocks``), then samples its own first token from
a copy of that row with its own seed stream, and decodes from the next step as any running request::

    step k:    choice 0 computes the prompt ---> logits row --+--> choice 0's first token (its seed)
                                                             +--> choice 1's (seed + 1), forked KV
                                                             +--> choice 2's (seed + 2), forked KV
    step k+1:  choices 0, 1, 2 decode side by side; full prompt blocks held three times, partial copied

A seeded choice samples exactly as an ``n = 1`` request with its seed would (the same logits, a
fresh generator with its seed), so the outputs are today's; only the prompt's compute is saved.

Disaggregated, the same in two engines: the prefill worker's ``add_choices(prefill_only=True)``
computes the prompt once and samples every choice's first token from choice 0's row; the KV is
sent once, into the decode worker's reservation for choice 0, and ``start_decode(..., choices=)``
forks the others off it there (``fork_decoded``). The served path reaches these calls through one
queue entry of n choices, the router (services/router/choices.py) and the workers
(services/decode/choices.py, services/handoff.py).

Failure and cancellation: a choice aborted before the fork is dropped from it. Choice 0 ending
before its prompt is done (aborted) turns the waiting choices into ordinary
requests, which find the full prompt blocks in the prefix cache. So does a fork with no free block
for the copy. Every choice frees what it holds as any request does; shared blocks are
reference-counted, so the last holder frees them.
"""

from __future__ import annotations

import torch

from services.engine.outputs import RequestOutput
from services.engine.request import Request
from services.errors import InvalidRequestError


def forking_rows(sampled: list[Request], logits: torch.Tensor, drafts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The logits row of each request that forks this step, copied before the sampler changes it in place.
    A verifying request owns one row per draft and one more (runner.py); a forking one verifies none."""
    rows: dict[str, torch.Tensor] = {}
    row = 0
    for req in sampled:
        if req.forks:
            rows[req.request_id] = logits[row].clone()
        row += 1 + len(drafts.get(req.request_id, ()))
    return rows


def _fork_kv(engine, parent: Request, child: Request, copies: list[tuple[int, int]]) -> bool:
    """The child takes the parent's computed KV (KVManager.fork; the block copy queued on ``copies``);
    False when no block is free for the copy."""
    try:
        copy = engine.kv.fork(parent, child)
    except MemoryError:
        return False
    if copy is not None:
        copies.append(copy)
    child.num_prefix_hit_tokens = child.num_computed_tokens  # its whole prompt came from choice 0
    return True


def _start(engine, child: Request, token: int, logprobs, outputs: list[RequestOutput]) -> None:
    """A forked choice's first token: appended (which may finish it), then it decodes with the others."""
    output = engine._append_tokens(child, [token], [logprobs])
    if not child.is_finished:
        engine.scheduler.add_running(child)
    outputs.append(output)


def fork_choices(engine, parent: Request, row: torch.Tensor, outputs: list[RequestOutput]) -> None:
    """Fork ``parent``'s waiting choices off its just-computed prompt: shared full blocks, copied partial
    block, each choice's first token sampled from ``row`` with its own seed. Call once the parent's
    computed-token count covers its prompt, before its own first token is appended (which may finish it).
    A prefill-only parent's choices only sample: each ends ``prefilled`` with its first token, for the
    decode worker that forks them off the KV sent once (``fork_decoded``)."""
    children = [c for c in parent.forks if not c.is_finished]
    parent.forks = []
    if parent.prefill_only:
        out = engine.sampler(row.expand(len(children), -1).clone(), children) if children else None
        for i, child in enumerate(children):
            child.append_output(out.token_ids[i])
            engine._finish(child, "prefilled")
            output = engine._output(child, [out.token_ids[i]], [out.logprobs[i]])
            output.finished, output.finish_reason = True, "prefilled"
            outputs.append(output)
        return
    forked: list[Request] = []
    copies: list[tuple[int, int]] = []
    for child in children:
        if _fork_kv(engine, parent, child, copies):
            forked.append(child)
        else:  # no block for the copy: an ordinary request, hitting the full blocks cached
            engine.scheduler.add(child)
    if not forked:
        return
    engine.runner.copy_blocks(copies)
    out = engine.sampler(row.expand(len(forked), -1).clone(), forked)
    for child, token, logprobs in zip(forked, out.token_ids, out.logprobs):
        _start(engine, child, token, logprobs, outputs)


def decoded_choices(engine, parent: Request, choices) -> list[tuple[Request, int, object]]:
    """``start_decode``'s choices (id, params, first token, its logprobs) as requests beside ``parent``'s
    reservation, each checked before any is tracked (a bad one refuses them all, changing nothing)."""
    for rid, params, _, _ in choices:
        if rid in engine.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        engine.validate(parent.prompt_token_ids, params)
        if params.structured is not None or params.lora is not None:
            raise InvalidRequestError("forked choices take no structured output or LoRA adapter", param="n")
    children = []
    for rid, params, token, logprobs in choices:
        child = Request(rid, list(parent.prompt_token_ids), params, priority=parent.priority,
                        eos_token_ids=parent.eos_token_ids)
        engine._track(child)
        children.append((child, token, logprobs))
    return children


def fork_decoded(engine, parent: Request, children: list[tuple[Request, int, object]],
                 outputs: list[RequestOutput]) -> None:
    """Decode side of a disaggregated request with n choices: the prompt's KV arrived once, in ``parent``'s
    blocks; each (child, first token sampled on the prefill worker, its logprobs) forks off it. A child
    with no block for the copy recomputes its prompt and first token as a preempted request does (its
    full blocks are cached hits)."""
    copies: list[tuple[int, int]] = []
    forked = [(c, t, lp) for c, t, lp in children if _fork_kv(engine, parent, c, copies)]
    engine.runner.copy_blocks(copies)
    for child, token, logprobs in children:
        if any(child is c for c, _, _ in forked):
            _start(engine, child, token, logprobs, outputs)
        else:
            output = engine._append_tokens(child, [token], [logprobs])
            if not child.is_finished:
                engine.scheduler.add(child)
            outputs.append(output)


def release_forks(engine, parent: Request) -> None:
    """``parent`` ends before forking (aborted): its waiting choices run on their own, as ordinary requests
    (prefill-only ones end with it: their first tokens only make sense beside its KV)."""
    for child in parent.forks:
        if child.is_finished:
            continue
        if parent.prefill_only:
            engine._finish(child, "abort")
            engine._pending.append(engine._output(child, [], None))
        else:
            engine.scheduler.add(child)
    parent.forks = []
