"""Prompt-lookup drafts and the per-request speculation policy (no model, no torch)."""

from __future__ import annotations

import random

import pytest

from services.config import SpeculativeConfig
from services.engine.ngram_proposer import NgramIndex
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.speculator import FIRST_BACKOFF, Speculator


def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by brute force: longest suffix n-gram first, its latest earlier occurrence,
    then the tokens after it (continuing as a loop past the end)."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n:]
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n:e] == suffix:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[e + i])
                return seq[end:]
    return []


def test_longest_suffix_match_wins_over_a_later_shorter_one():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 7, 2, 6, 7]  # suffix "6 7" occurs at 1-2 (followed by 8 9); "7" later at 6
    assert NgramIndex(1, 4).propose(tokens, 3) == [8, 9, 1]


def test_latest_occurrence_of_the_same_ngram_wins():
    tokens = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    assert NgramIndex(2, 2).propose(tokens, 2) == [5, 6]


def test_a_loop_drafts_its_own_continuation():
    tokens = [9, 4, 5, 6, 4, 5, 6, 4, 5]  # period 3
    assert NgramIndex(1, 4).propose(tokens, 5) == [6, 4, 5, 6, 4]
    assert NgramIndex(1, 1).propose([3, 3, 3], 4) == [3, 3, 3, 3]


def test_no_match_no_draft():
    assert NgramIndex(1, 4).propose([1, 2, 3, 4, 5], 5) == []
    assert NgramIndex(2, 4).propose([1, 2, 3, 1], 5) == []  # "1" repeats, but min n is 2
    assert NgramIndex(1, 4).propose([7], 5) == []


def test_incremental_index_equals_the_definition_as_the_sequence_grows():
    rng = random.Random(0)
    for trial in range(30):
        min_n, max_n = rng.choice([(1, 4), (2, 3), (1, 1), (3, 5)])
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        for _ in range(40):
            k = rng.randint(1, 6)
            assert index.propose(tokens, k) == naive_propose(tokens, k, min_n, max_n), (trial, tokens)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 4))]  # accepted drafts: several at once


# ---- the policy ------------------------------------------------------------------------------------


def decoding(rid: str, prompt: list[int], output: list[int] = (), **params) -> Request:
    req = Request(rid, list(prompt), SamplingParams(**{"temperature": 0, **params}))
    for t in output:
        req.append_output(t)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_only_decoding_requests_draft_and_drafts_stop_at_max_tokens_and_the_context():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=5), max_model_len=30)
    loop = [1, 2, 3] * 4
    free = decoding("free", loop, max_tokens=100)
    near_max = decoding("near-max", loop, output=[1, 2], max_tokens=5)  # 3 more tokens: 2 drafts + 1
    near_context = decoding("near-ctx", loop * 2, output=[1, 2, 3, 1], max_tokens=None)  # 28 of 30 tokens
    prefilling = decoding("prefilling", loop)
    prefilling.num_computed_tokens = 4
    last_token = decoding("last", loop, output=[1, 2, 3, 1], max_tokens=5)
    reqs = [free, near_max, near_context, prefilling, last_token]
    spec.propose(reqs)
    assert free.spec_token_ids == [1, 2, 3, 1, 2]
    assert near_max.spec_token_ids == [3, 1]
    assert near_context.spec_token_ids == [2]
    assert prefilling.spec_token_ids == [] and last_token.spec_token_ids == []


def test_draft_length_and_pauses_follow_acceptance():
    cfg = SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.25, window=2)
    spec = Speculator(cfg, max_model_len=10_000)
    req = decoding("r", [1, 2, 3, 9] * 3, max_tokens=None)  # a 9 always has a draft after it

    def step(accepted: int | None) -> int:
        """One verifying step accepting ``accepted`` draft tokens (None: all); returns the draft length."""
        spec.propose([req])
        drafted = len(req.spec_token_ids)
        assert drafted > 0
        kept = drafted if accepted is None else accepted
        for t in req.spec_token_ids[:kept] + [9]:
            req.append_output(t)
        req.num_computed_tokens = req.num_tokens - 1
        spec.record(req, drafted, kept)  # as the engine does: after the step's tokens are in
        return drafted

    def plain_steps() -> int:
        """Decode steps without a draft until drafting resumes."""
        n = 0
        while spec.propose([req]) or not req.spec_token_ids:
            req.append_output(9)
            req.num_computed_tokens = req.num_tokens - 1
            n += 1
        return n

    assert [step(0), step(1)] == [4, 3]  # each rejection shortens the next draft by 1
    assert spec.num_pauses == 1  # 1 of 7 accepted over the window (< 25%): paused
    assert plain_steps() == FIRST_BACKOFF
    assert [step(0), step(0)] == [2, 1]  # never below 1
    assert plain_steps() == 2 * FIRST_BACKOFF  # a failed probe doubles the pause
    assert [step(None), step(0)] == [1, 3]  # a whole accepted draft lengthens the next by 2
    assert spec.num_pauses == 2  # 1 of 4: good, and the backoff is back to the first
    assert [step(None), step(None), step(None)] == [2, 4, 4]  # up to k
    assert step(0) == 4 and step(0) == 3  # 0 of 7 over the window: paused for the first backoff again
    assert plain_steps() == FIRST_BACKOFF
    assert spec.stats()["spec_pauses"] == 3


@pytest.mark.parametrize("bad", [dict(num_speculative_tokens=0), dict(prompt_lookup_min=0),
                                 dict(prompt_lookup_min=3, prompt_lookup_max=2), dict(method="eagle"),
                                 dict(min_acceptance=1.5), dict(window=0)])
def test_bad_speculative_config_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        SpeculativeConfig(**bad)
