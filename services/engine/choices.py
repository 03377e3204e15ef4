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


def fork_choices(engine, parent: Request, row: torch.Tensor, outputs: list[RequestOutput]) -> None:
    """Fork ``parent``'s waiting choices off its just-computed prompt: shared full blocks, copied partial
    block, each choice's first token sampled from ``row`` with its own seed. Call once the parent's
    computed-token count covers its prompt, before its own first token is appended (which may finish it)."""
    children = [c for c in parent.forks if not c.is_finished]
    parent.forks = []
    forked: list[Request] = []
    copies: list[tuple[int, int]] = []
    for child in children:
        try:
            copy = engine.kv.fork(parent, child)
        except MemoryError:  # no block for the copy: an ordinary request, hitting the full blocks cached
            engine.scheduler.add(child)
            continue
        if copy is not None:
            copies.append(copy)
        child.num_prefix_hit_tokens = child.num_computed_tokens  # its whole prompt came from choice 0
        forked.append(child)
    if not forked:
        return
    engine.runner.copy_blocks(copies)
    out = engine.sampler(row.expand(len(forked), -1).clone(), forked)
    for child, token, logprobs in zip(forked, out.token_ids, out.logprobs):
        output = engine._append_tokens(child, [token], [logprobs])
        if not child.is_finished:
            engine.scheduler.add_running(child)
        outputs.append(output)


def release_forks(engine, parent: Request) -> None:
    """``parent`` ends before forking (aborted, or finished on its prefill): its waiting choices run on
    their own, as ordinary requests."""
    for child in parent.forks:
        if not child.is_finished:
            engine.scheduler.add(child)
    parent.forks = []
