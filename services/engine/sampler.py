"""Next-token sampling for a batch of requests, each with its own parameters.

Per row, in order: penalties (repetition on prompt + output; presence and
frequency on output), then greedy argmax, or temperature, top-k, top-p, min-p
and a draw. Draws use the exponential race (argmax of p / Exp(1)), which is a
categorical sample; a request with a seed draws its noise from its own
generator, so its output does not depend on what it was batched with.
Logprobs are of the raw model distribution, before any of the above. A structured-output
row's grammar mask (``grammar_masks.py``) comes before everything: forbidden tokens get -inf.
Then a request's ``logit_bias`` is added to its rows (a forbidden token stays forbidden:
-inf plus a bias is -inf), before penalties, so greedy rows and structured rows see it too.

Speculative decoding (``verify``): a request brings draft tokens and one logits row per
position. Draft token x_j at a row whose (penalised, filtered) distribution is p_j is
accepted with probability min(1, p_j(x_j) / q_j(x_j)), q_j being the draft's distribution;
on rejection the row's token is drawn from norm(max(0, p_j - q_j)) and the rest of the draft
is dropped; a wholly accepted draft earns a bonus token from the last row. That is the
standard rejection-sampling rule (Leviathan et al. 2023, Chen et al. 2023): the emitted
tokens are distributed exactly as if drawn from p one at a time. An n-gram draft is
deterministic, q_j is a point mass on x_j, so: accept with probability p_j(x_j), else draw
from p_j with x_j removed. Greedy rows accept exactly when x_j is the argmax, so greedy
output is the tokens plain decoding gives. Penalties of row j count the draft tokens before
it as output, as plain decoding would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.outputs import TokenLogprobs
from services.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass
class VerifiedOutput:
    token_ids: list[list[int]]  # per request: accepted draft tokens, then one of the model's own
    logprobs: list[list[TokenLogprobs | None]]


def _apply_penalties(logits: torch.Tensor, rows: list[tuple[int, Request, list[int]]]) -> None:
    """``rows``: (row, request, draft tokens before this row), the drafts counting as output."""
    for row, req, before in rows:
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids).union(before)), device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        output = req.output_token_ids + before
        if (p.presence_penalty or p.frequency_penalty) and output:
            counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[1])
            counts = counts.to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _add_bias(logits: torch.Tensor, start: int, count: int, bias: dict[int, float]) -> None:
    """A request's logit_bias on its ``count`` rows from ``start`` (ids were checked against the vocabulary)."""
    ids = torch.tensor(list(bias), device=logits.device)
    values = torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
    logits[start:start + count, ids] += values


def _filter(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on the rows of ``logits`` (one per req)."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in reqs], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_ks = [r.params.top_k if r.params.top_k > 0 else 0 for r in reqs]
    top_ps = [r.params.top_p for r in reqs]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = torch.tensor([k or vocab for k in top_ks], device=dev)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= k[:, None]
        probs = sorted_logits.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= torch.tensor(top_ps, device=dev, dtype=probs.dtype)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    min_ps = [r.params.min_p for r in reqs]
    if any(min_ps):
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=dev, dtype=probs.dtype)[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def skip_draw(self, req: Request, vocab_size: int, device: torch.device) -> None:
        """``req``'s first token was sampled by another engine (the prefill worker, from the same seed):
        advance its random stream past that draw, so this engine's draws go on where that one's stopped
        and a seeded request gives the tokens it would give in one engine."""
        if req.params.seed is not None and not req.params.greedy:
            torch.empty(1, vocab_size, device=device).exponential_(generator=self._generator(req, device))

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(req.params.seed)
            self._generators[req.request_id] = gen
        return gen

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 blocked: torch.Tensor | None = None) -> SamplerOutput:
        """One token per request. ``logits``: fp32 ``[len(reqs), vocab]``; modified in place (the
        runner's logits are inference tensors, so this must run in inference mode too).
        ``blocked``: bool ``[len(reqs), vocab]``, True for tokens a row's grammar forbids
        (structured output); they get no probability, before penalties and filters."""
        out = self.verify(logits, reqs, [()] * len(reqs), blocked)
        return SamplerOutput([t[0] for t in out.token_ids], [lp[0] for lp in out.logprobs])

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, reqs: list[Request], drafts: list,
               blocked: torch.Tensor | None = None) -> VerifiedOutput:
        """Tokens per request, given draft tokens to check. Request i owns ``len(drafts[i]) + 1``
        consecutive rows of ``logits``: the model's distribution after its last token, then after
        each draft token. It gets the longest prefix of its draft the model accepts, then one token
        of the model's own (a replacement for the first rejected draft, or a bonus token after the
        whole draft): 1 to ``len(draft) + 1`` tokens. A request without a draft is sampled as usual.

        Acceptance (see the module docstring): greedy rows accept a draft token that is the
        argmax; sampled rows accept it with probability p(draft) and on rejection draw from p
        without it, which leaves the output distribution exactly p (a draft is a point mass).
        ``logits`` is modified in place."""
        row_req: list[Request] = []
        starts: list[int] = []
        penalised: list[tuple[int, Request, list[int]]] = []
        for req, draft in zip(reqs, drafts):
            starts.append(len(row_req))
            if req.params.needs_penalties:
                penalised += [(len(row_req) + j, req, list(draft[:j])) for j in range(len(draft) + 1)]
            row_req += [req] * (len(draft) + 1)
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        if blocked is not None:  # one row per request: constrained requests never have drafts
            logits.masked_fill_(blocked, float("-inf"))
        for i, req in enumerate(reqs):
            if req.params.logit_bias:
                _add_bias(logits, starts[i], len(drafts[i]) + 1, req.params.logit_bias)
        if penalised:
            _apply_penalties(logits, penalised)

        choice = logits.argmax(dim=-1)  # per row: the greedy token, or below the sampled one
        accepted: dict[int, bool] = {}  # sampled draft rows: whether their draft token is accepted
        random_reqs = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_reqs:
            rows = [starts[i] + j for i in random_reqs for j in range(len(drafts[i]) + 1)]
            probs = _filter(logits[rows], [row_req[r] for r in rows]).softmax(dim=-1)
            noise = torch.empty_like(probs)
            at = 0
            for i in random_reqs:
                req, draft = reqs[i], drafts[i]
                gen = None if req.params.seed is None else self._generator(req, probs.device)
                block = slice(at, at + len(draft) + 1)
                noise[block].exponential_(generator=gen)
                if draft:
                    u = torch.rand(len(draft), generator=gen, device=probs.device)
                    ids = torch.tensor(list(draft), device=probs.device)
                    draft_rows = torch.arange(at, at + len(draft), device=probs.device)
                    p = probs[draft_rows, ids]
                    for j, ok in enumerate((u < p).tolist()):
                        accepted[starts[i] + j] = ok
                    probs[draft_rows, ids] = 0.0  # a rejected row resamples from p without its draft
                at += len(draft) + 1
            choice[rows] = (probs / noise).argmax(dim=-1)

        chosen = choice.tolist()
        out = VerifiedOutput([], [])
        for i, (req, draft) in enumerate(zip(reqs, drafts)):
            row = starts[i]
            tokens = []
            for d in draft:
                if not (accepted[row] if row in accepted else chosen[row] == d):
                    break
                tokens.append(d)
                row += 1
            tokens.append(chosen[row])  # the replacement, or the bonus token after a whole draft
            out.token_ids.append(tokens)
            out.logprobs.append([self._logprobs(raw_logprobs, starts[i] + j, t, req) for j, t in enumerate(tokens)])
        return out

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, row: int, token: int, req: Request) -> TokenLogprobs | None:
        n = req.params.logprobs
        if raw is None or n is None:
            return None
        top = []
        if n:
            vals, ids = raw[row].topk(n)
            top = list(zip(ids.tolist(), vals.tolist()))
        return TokenLogprobs(token, raw[row, token].item(), top)
