"""Verifying draft tokens (Sampler.verify): greedy keeps exactly the argmax path; sampling
keeps the target distribution (the rejection-sampling rule), checked statistically."""

from __future__ import annotations

import pytest
import torch

from services.engine.request import Request
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams

V = 6


def req(rid: str, **params) -> Request:
    return Request(rid, [3], SamplingParams(**params))


def test_greedy_keeps_the_drafts_the_argmax_agrees_with_then_the_argmax():
    # rows: "all" 0-3 (3 drafts), "none" 4-5 (1 draft), "plain" 6 (none), "some" 7-9 (2 drafts)
    logits = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
    top = logits.argmax(-1).tolist()
    reqs = [req(name, temperature=0) for name in ("all", "none", "plain", "some")]
    drafts = [top[0:3], [(top[4] + 1) % 32], [], [top[7], (top[8] + 1) % 32]]
    out = Sampler().verify(logits.clone(), reqs, drafts)
    assert out.token_ids == [top[0:4], [top[4]], [top[6]], [top[7], top[8]]]


def test_a_draft_the_filters_exclude_is_never_accepted():
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    top, other = logits[0].argmax().item(), logits[0].argmin().item()
    reqs = [req(f"r{i}", temperature=1.0, top_k=1) for i in range(50)]
    out = Sampler().verify(logits.repeat(50, 1), reqs, [[other]] * 50)
    assert out.token_ids == [[top]] * 50


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``observed`` counts against ``expected_probs``
    (categories expected to be empty are left out: a count there fails the test outright)."""
    n = observed.sum()
    keep = expected_probs > 0
    assert observed[~keep].sum() == 0, f"drew a token of probability 0: {observed.tolist()}"
    exp = expected_probs[keep] * n
    chi2 = ((observed[keep] - exp) ** 2 / exp).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2.double() / 2).item()


def target_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution a row must be sampled from, written out independently of the sampler."""
    scaled = logits.double() / temperature
    if top_k:
        cut = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < cut, float("-inf"))
    return scaled.softmax(-1)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)],
                         ids=["t=1", "t=0.7,top_k=4"])
def test_sampled_output_follows_the_target_distribution_whatever_the_draft(params):
    """Rows p0..p3 are the model's distributions after the last token and after each draft token
    (d0, d1, d2), as in a verifying step. Whatever the drafts, the emitted tokens must be
    distributed as if drawn from p0, then (if that was d0) from p1, and so on: the first token
    ~ p0; the second, among requests whose first token was d0, ~ p1; ...; the bonus ~ p3."""
    torch.manual_seed(1234)  # fixed: the test is deterministic, its threshold a real p-value
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5],
                           [0.0, 0.3, 2.5, 0.1, 0.2, -0.5],
                           [1.0, 0.8, 0.6, 0.4, 0.2, 0.0],
                           [-1.0, 3.0, 0.1, 0.5, 1.0, 0.0]])  # no ties: top_k is then unambiguous
    drafts = [1, 2, 0]  # p0(d0) ~ 0.15, p1(d1) ~ 0.7, p2(d2) ~ 0.26: each row is reached >= 1,000 times
    n = 40_000
    reqs = [req(f"r{i}", **params) for i in range(n)]
    out = Sampler().verify(logits.repeat(n, 1), reqs, [drafts] * n)

    probs = target_probs(logits, params["temperature"], params.get("top_k", 0))
    alive = list(out.token_ids)  # requests whose tokens so far all equal the draft
    for j in range(4):
        counts = torch.bincount(torch.tensor([t[j] for t in alive]), minlength=V).double()
        assert counts.sum() >= 900, f"only {counts.sum()} requests reach position {j}"
        assert chi_square_p(counts, probs[j]) > 1e-4, (j, counts.tolist(), probs[j].tolist())
        for t in alive:  # a token that is not the draft ends the step's tokens
            assert len(t) == j + 1 or (j < 3 and t[j] == drafts[j])
        alive = [t for t in alive if j < 3 and t[j] == drafts[j]]


def test_seeded_verification_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(3)) * 0.5
    draft = logits[:3].argmax(-1).tolist()  # likely drafts, so some are accepted
    runs = []
    for others in ([], [req("x", temperature=1.0), req("y", temperature=0)]):
        sampler = Sampler()
        seq = []
        for _ in range(30):
            batch = others + [req("s", temperature=1.0, seed=7)]
            rows = torch.cat([torch.randn(len(others), 16), logits]) if others else logits
            drafts = [[]] * len(others) + [draft]
            seq.append(tuple(sampler.verify(rows.clone(), batch, drafts).token_ids[-1]))
        runs.append(seq)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 3  # random, not stuck


def test_logprobs_of_accepted_drafts_are_their_rows_raw_logprobs():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(-1).tolist()
    out = Sampler().verify(logits.clone(), [req("r", temperature=0, logprobs=2)], [top[:2]])
    assert out.token_ids == [top]
    raw = logits.log_softmax(-1)
    for row, lp in enumerate(out.logprobs[0]):
        assert lp.token_id == top[row]
        assert lp.logprob == pytest.approx(raw[row, top[row]].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == raw[row].topk(2).indices.tolist()


def test_penalties_count_the_drafts_before_each_row():
    """Token 0 leads every row by a little; a presence penalty applies to row 1 only if the draft
    token 0 before it counts as output, which turns row 1's choice to token 1."""
    logits = torch.full((2, 16), -10.0)
    logits[:, 0], logits[:, 1] = 2.0, 1.5
    out = Sampler().verify(logits.clone(), [req("r", temperature=0, presence_penalty=1.0)], [[0]])
    assert out.token_ids == [[0, 1]]
