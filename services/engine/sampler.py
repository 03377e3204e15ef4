"""Next-token sampling for a batch of requests, each with its own parameters.

Per row, in order: penalties (repetition on prompt + output; presence and
frequency on output), then greedy argmax, or temperature, top-k, top-p, min-p
and a draw. Draws use the exponential race (argmax of p / Exp(1)), which is a
categorical sample; a request with a seed draws its noise from its own
generator, so its output does not depend on what it was batched with.
Logprobs are of the raw model distribution, before any of the above.
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


def _apply_penalties(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    for row in rows:
        p = reqs[row].params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(reqs[row].all_token_ids)), device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and reqs[row].output_token_ids:
            out = torch.tensor(reqs[row].output_token_ids, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


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

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(req.params.seed)
            self._generators[req.request_id] = gen
        return gen

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """``logits``: fp32 ``[len(reqs), vocab]``; modified in place (the runner's logits are
        inference tensors, so this must run in inference mode too)."""
        want_logprobs = [r.params.logprobs is not None for r in reqs]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None

        penalised = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        if penalised:
            _apply_penalties(logits, penalised, reqs)

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            sub = [reqs[i] for i in random_rows]
            probs = _filter(logits[random_rows], sub).softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, req in enumerate(sub):
                if req.params.seed is None:
                    noise[j].exponential_()
                else:
                    noise[j].exponential_(generator=self._generator(req, probs.device))
            tokens[random_rows] = (probs / noise).argmax(dim=-1)

        token_list = tokens.tolist()
        out: list[TokenLogprobs | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for i, r in enumerate(reqs):
                if not want_logprobs[i]:
                    continue
                n = r.params.logprobs
                top = []
                if n:
                    vals, ids = raw_logprobs[i].topk(n)
                    top = list(zip(ids.tolist(), vals.tolist()))
                out[i] = TokenLogprobs(token_list[i], raw_logprobs[i, token_list[i]].item(), top)
        return SamplerOutput(token_list, out)
